"""hpcdl: data-parallel training of image classifiers on CPU supercomputers run by Slurm."""

__version__ = "0.1.0"
