"""Gradient synchronization: DDP over the job's process group, timed (:mod:`.ddp`), and the communication
hooks chosen by ``sync.hook`` (:mod:`.hooks`)."""
