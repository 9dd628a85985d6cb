"""The process-group core every backend shares: joining the job's group (:mod:`.lifecycle`), the torch Backend
written in Python (:mod:`.python_backend`) and its communication thread (:mod:`.comm_thread`), liveness: the
heartbeat and the naming of a lost rank (:mod:`.liveness`), rank 0's reads handed to every rank (:mod:`.share`),
and the torch.distributed plugin entry points (:mod:`.plugin`)."""
