"""Rank discovery: which rank this process is, how many there are and where they meet (the launchers'
variables as a table, :mod:`.env`), and Slurm's hostlist expressions (:mod:`.hostlist`). Torch-free."""
