"""What the supervisor reads of the allocation's nodes: how many to run on (:func:`fit_nodes`), which a rescue
names lost (:func:`lost_nodes`), which srun reports its tasks exited on (:data:`TASK_EXIT`), and the job's steps by
name (:func:`steps_named`). Torch-free; the asking of nodes themselves is :mod:`hpcdl.launch.probe`'s."""

from __future__ import annotations

import re
import subprocess

__all__ = ["TASK_EXIT", "fit_nodes", "lost_nodes", "steps_named"]


def fit_nodes(available: int, tasks_per_node: int, global_batch: int) -> int:
    """The most nodes, up to ``available``, whose ranks divide ``global_batch`` (0 when none does)."""
    return next((n for n in range(available, 0, -1) if global_batch % (n * tasks_per_node) == 0), 0)


_NODE = re.compile(r"Slurm node (\S+?)\)")


def lost_nodes(result: dict, used: list[str], tasks_per_node: int) -> list[str]:
    """The nodes of the ranks a rescue found lost: the heartbeat's record names each rank's node; rank 0's
    (whose store is gone when it is lost) follows from srun's block distribution of ranks over ``used``."""
    found = []
    for rank in result.get("lost") or []:
        where = _NODE.search((result.get("lost_where") or {}).get(str(rank), ""))
        node = where.group(1) if where else used[int(rank) // tasks_per_node]
        if node not in found:
            found.append(node)
    return found


TASK_EXIT = re.compile(  # srun's report of a node's tasks that exited: (node, why)
    r"srun: error: (\S+): tasks? [\d,\-]+: (.+)")


def steps_named(job: str, name: str) -> list[str]:
    """The ids of the job's steps called ``name`` (squeue -s)."""
    try:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [i.split(".", 1)[1] for i, _, j in (line.partition(" ") for line in out.splitlines()) if j == name and "." in i]
