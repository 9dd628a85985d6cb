"""A rank's training: the trainer (``trainer``), its step (``step``), checkpoints, evaluation, metrics, precision,
the requeue signal (``preempt``) and the just-in-time checkpoint (``rescue``). ``job`` is the old home of the
submitit job (:mod:`hpcdl.launch.train_job`), kept for jobs submitted before it moved.

``python -m hpcdl.train CONFIG --set key=value`` is ``hpcdl train``.
"""
