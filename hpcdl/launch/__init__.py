"""Launching jobs: cluster profiles, sbatch scripts, and submitit."""

from hpcdl.launch.executor import submit
from hpcdl.launch.job import JobRequest, job_request
from hpcdl.launch.profiles import PROFILES, ClusterProfile, get_profile

__all__ = ["PROFILES", "ClusterProfile", "JobRequest", "get_profile", "job_request", "submit"]
