"""Asking nodes before a step uses them: does the node's slurmd answer, does it run a one-task step, does the ranks'
Python start there (:class:`hpcdl.launch.supervisor.Supervisor`'s probes of suspects and spares). Each is bounded."""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import time

__all__ = ["python_failures", "slurmd_addresses", "unanswering"]


def python_failures(nodes: list[str], rank_command: list[str], timeout_s: float) -> dict[str, str | None]:
    """Each node's failure to start the ranks' Python and import hpcdl's trainer (None: it did), bounded."""
    at = next((i for i in range(len(rank_command) - 1) if rank_command[i:i + 2] == ["-m", "hpcdl"]), None)
    if at is None:
        return dict.fromkeys(nodes)
    command = [*rank_command[:at], "-c", "import hpcdl.train.trainer"]

    def one(node: str) -> str | None:
        try:
            run = subprocess.run(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", *command],
                                 capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"its Python did not import hpcdl.train.trainer within {timeout_s:.0f} s"
        if run.returncode == 0:
            return None
        said = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("srun: ")]
        return (f"its Python cannot start the ranks (python -c 'import hpcdl.train.trainer' exited "
                f"{run.returncode}: {(said or ['no message'])[-1].strip()[:300]})")
    with concurrent.futures.ThreadPoolExecutor(min(8, max(1, len(nodes)))) as pool:
        return dict(zip(nodes, pool.map(one, nodes)))


def unanswering(nodes: list[str], timeout_s: float) -> list[str]:
    """The nodes among ``nodes`` that cannot run a one-task step within the bound."""
    addresses = slurmd_addresses(nodes)

    def answers(node: str) -> bool:
        if node in addresses:
            try:
                socket.create_connection(addresses[node], timeout=timeout_s).close()
            except OSError:  # refused (no slurmd), unreachable, or no answer in time
                return False
        proc = subprocess.Popen(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "true"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.set_blocking(proc.stderr.fileno(), False)
        said, deadline = b"", time.monotonic() + timeout_s
        try:
            while proc.poll() is None:
                said += proc.stderr.read() or b""
                # srun says so at once when the node's slurmd refuses the launch, then waits on
                if b"Communication connection failure" in said or time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
            return proc.returncode == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.close()
    with concurrent.futures.ThreadPoolExecutor(min(32, max(1, len(nodes)))) as pool:
        alive = list(pool.map(answers, nodes))
    return [n for n, ok in zip(nodes, alive) if not ok]


def slurmd_addresses(nodes: list[str]) -> dict[str, tuple[str, int]]:
    """Each node's slurmd address and port, from ``scontrol show node`` (the configured ``SlurmdPort`` where the
    node names none); nodes Slurm does not describe are left out."""
    try:
        text = subprocess.run(["scontrol", "show", "node", "-o", ",".join(nodes)], capture_output=True, text=True,
                              timeout=30).stdout
        default = re.search(r"^SlurmdPort\s*=\s*(\d+)", subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout, re.M)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        port = fields.get("Port") or (default.group(1) if default else None)
        if fields.get("NodeName") in nodes and fields.get("NodeAddr") and port and port.isdigit():
            found[fields["NodeName"]] = (fields["NodeAddr"], int(port))
    return found
