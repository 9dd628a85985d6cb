"""``hpcdl`` with a stall injected on one rank: a stand-in for a slow phase (a cold Lustre read of a
checkpoint, a torch.compile of the first step, a rank that starts late). The stall is a sleep, the rest is
the real trainer.

    HPCDL_TEST_STALL="PHASE[,PHASE...]:SECONDS:RANK" python stall_ranks.py train ...

PHASE: rendezvous (before the process group), checkpoint (resume: load and broadcast), ddp (DDP and the
hook's groups), first_step (the first training step), step3 (the third step).
"""

import os
import sys
import time

import hpcdl.train.step
import hpcdl.train.trainer as trainer
from hpcdl.cli import main

phases, seconds, rank = os.environ["HPCDL_TEST_STALL"].split(":")
phases, seconds = set(phases.split(",")), float(seconds)
here = int(os.environ.get("RANK", "0")) == int(rank)


def stalled(phase, fn, on_call=1):
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if here and phase in phases and calls[0] == on_call:
            print(f"stall: rank {rank} sleeps {seconds:g} s in {phase}", file=sys.stderr, flush=True)
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return wrapper


trainer.init_distributed = stalled("rendezvous", trainer.init_distributed)
trainer.Trainer._resume = stalled("checkpoint", trainer.Trainer._resume)
trainer.data_parallel = stalled("ddp", trainer.data_parallel)
step = hpcdl.train.step.Stepper.step
hpcdl.train.step.Stepper.step = stalled("step3", stalled("first_step", step), on_call=3)
sys.exit(main(sys.argv[1:]))
