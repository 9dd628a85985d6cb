"""Training: the trainer (``trainer``), its step (``step``), checkpoints, evaluation, metrics, precision,
the requeue signal (``preempt``) and the submitit job (``job``).

``python -m hpcdl.train CONFIG --set key=value`` is ``hpcdl train``.
"""
