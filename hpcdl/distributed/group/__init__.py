"""The process-group core every backend shares: joining the job's group (:mod:`.lifecycle`), rank 0's rendezvous
store and the count of its requests (:mod:`.store`), liveness: the heartbeat and the naming of a lost rank
(:mod:`.liveness`), the torch Backend written in Python (:mod:`.python_backend`), its Works (:mod:`.work`) and its
communication thread (:mod:`.comm_thread`), rank 0's reads handed to every rank (:mod:`.share`), and the
torch.distributed plugin entry points (:mod:`.plugin`)."""
