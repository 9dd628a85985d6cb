"""Launching jobs: cluster profiles, sbatch scripts, and submitit.

``submit`` is imported on first use: submitit's import costs a tenth of a second that the commands which
only read profiles or write scripts (every ``hpcdl`` command builds the parser that reads them) need not pay.
"""

from hpcdl.launch.executor import submit
from hpcdl.launch.profiles import PROFILES, ClusterProfile, get_profile
from hpcdl.launch.request import JobRequest, job_request

__all__ = ["PROFILES", "ClusterProfile", "JobRequest", "get_profile", "job_request", "submit"]


def __getattr__(name: str):
    if name == "submit":
        return submit
    raise AttributeError(f"module 'hpcdl.launch' has no attribute {name!r}")
