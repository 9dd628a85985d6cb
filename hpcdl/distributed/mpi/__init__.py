"""MPI through mpi4py: the process group (:mod:`.group`) and what MPI needs before it starts, torch-free
(:mod:`.runtime`)."""
