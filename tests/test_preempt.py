"""The requeue signal: all ranks stop at the same step; requeue targets and bounds."""

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import PYTHON, REPO, free_port, rank_env

from hpcdl.errors import ConfigError, LaunchError
from hpcdl.train.preempt import StopSignal, requeue, requeue_target


@pytest.mark.ranks
@pytest.mark.parametrize("signalled", [0, 1])
def test_ranks_stop_together_whichever_rank_is_signalled(tmp_path, signalled):
    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(REPO / "tests" / "stop_ranks.py"), str(tmp_path)],
                              env=rank_env(r, 2, port)) for r in range(2)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    procs[signalled].send_signal(signal.SIGUSR2)
    if signalled == 1:  # rank 0 decides: a signal only rank 1 saw does not stop the job...
        time.sleep(1.0)
        assert all(p.poll() is None for p in procs)
        procs[0].send_signal(signal.SIGUSR2)  # ...until rank 0 sees it too (Slurm signals every rank)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["step"] == ranks[1]["step"] > 0 and ranks[0]["seen"]


def test_requeue_targets_and_bounds(monkeypatch):
    assert requeue_target({"SLURM_JOB_ID": "42"}) == "42"
    assert requeue_target({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}) == "40_3"
    assert requeue_target({}) is None
    assert requeue(3, {}) is False
    assert requeue(3, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3"}) is False  # bounded: no scontrol call
    with pytest.raises(ConfigError, match="not a signal name"):
        StopSignal("NOPE")
    stop = StopSignal("USR1")
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.agreed()  # without a process group: this rank's own answer
    stop.close()


def test_requeue_survives_the_sigterm_of_its_own_step(monkeypatch, tmp_path):
    """The requeue ends the step that asks for it, and slurmd's SIGTERM can reach scontrol before slurmctld's
    answer (CI, stop 41: requeued, yet scontrol died and rank 0 reported a failure). A fake scontrol on PATH
    delivers that SIGTERM to itself first, then answers; a second one is killed outright."""
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nkill -TERM $$\necho \"$@\" > {tmp_path}/asked\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    assert requeue(3, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}) is True
    assert (tmp_path / "asked").read_text() == "requeue 42\n"
    fake.write_text("#!/bin/sh\nkill -KILL $$\n")
    with pytest.raises(LaunchError, match=r"scontrol requeue 40_3 was killed by SIGKILL .*scontrol show job 40_3"):
        requeue(3, {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"})


def test_scontrol_requeue_runs_the_job_again_until_the_bound(slurm, tmp_path):
    from conftest import sbatch_wait

    script = tmp_path / "requeue.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
echo "run ${{SLURM_RESTART_COUNT:-0}}" >> {tmp_path}/runs
if {PYTHON} -c "import sys; from hpcdl.train.preempt import requeue; sys.exit(0 if requeue(1) else 1)"; then
  echo requeued; sleep 60   # scontrol requeue ends this run; the sleep never finishes
else
  echo final
fi
""")
    sbatch_wait(script, f"--output={tmp_path}/out", f"--chdir={tmp_path}", "--time=2", timeout=200,
                env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (tmp_path / "runs").read_text().split("\n")[:2] == ["run 0", "run 1"]
    out = (tmp_path / "out").read_text()
    assert "requeued" in out and "final" in out, out
