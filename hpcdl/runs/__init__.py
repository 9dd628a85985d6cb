"""A run seen from outside its ranks, torch-free, for the login node, the supervisor and the ranks alike: its folder
(:mod:`.folder`), the checks of a config against the job (:mod:`.preflight`), how it ended (:mod:`.outcome`), its
timelines (:mod:`.timeline`) and the orphaned step's beat (:mod:`.orphan`)."""
