"""``hpcdl`` with a fault injected on one rank at a named point: a stand-in for a slow phase (a cold Lustre
read, a torch.compile of the first step, a late start) or for a rank the OOM killer or a node failure
takes. The sleep and the SIGKILL are real; the rest is the real trainer.

    HPCDL_TEST_STALL="PHASE[,PHASE...]:SECONDS:RANK"  sleep at each PHASE
    HPCDL_TEST_KILL="PHASE:RANK"                      SIGKILL this process at PHASE
    HPCDL_TEST_STOP="PHASE:RANK"                      SIGSTOP this process at PHASE (a hung rank or node)
    python fault_ranks.py train ...

PHASE: rendezvous (before the process group), checkpoint (resume: load and broadcast), ddp (DDP and the
hook's groups), first_step, step3 (the first and third training steps); for kills also data (fetching
the 5th batch), forward (step 5's loss, between forward and backward), allreduce (step 5's first gradient
bucket handed to the hook; with hook none, half of step 5's gradients accumulated), gather (optimizer.shard's
all-gather of step 5, after this rank's update), save (half-way through writing the second checkpoint), eval (the
first evaluation).

The save phase writes half of step 4's checkpoint (every_steps=2: step 2's is complete).
"""

import functools
import io
import os
import signal
import sys
import time

import hpcdl.distributed.gradients.ddp
import hpcdl.optim.shard
import hpcdl.train.build as build
import hpcdl.train.checkpoint as checkpoint
import hpcdl.train.step
import hpcdl.train.trainer as trainer
import hpcdl.train.wrap as wrap
from hpcdl.cli import console

rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("SLURM_PROCID") or "0")
stall = os.environ.get("HPCDL_TEST_STALL")
kill = os.environ.get("HPCDL_TEST_KILL")
stalls, seconds, stall_rank = (stall.split(":") if stall else ("", "0", "-1"))
stalls, seconds = set(stalls.split(",")), float(seconds)
kill_phase, kill_rank = kill.split(":") if kill else ("", "-1")
stop = os.environ.get("HPCDL_TEST_STOP")
stop_phase, stop_rank = stop.split(":") if stop else ("", "-1")


def fault(phase, on_call=1):
    """Wrap a function: on its ``on_call``-th call in this rank, sleep or die as the variables say."""
    def wrap(fn):
        calls = [0]

        @functools.wraps(fn)  # DDP reads a comm hook's signature
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == on_call:
                if phase in stalls and rank == int(stall_rank):
                    print(f"stall: rank {rank} sleeps {seconds:g} s in {phase}", file=sys.stderr, flush=True)
                    time.sleep(seconds)
                if phase == kill_phase and rank == int(kill_rank):
                    die(phase)
                if phase == stop_phase and rank == int(stop_rank):
                    print(f"fault: rank {rank} (pid {os.getpid()}) SIGSTOPped in {phase}", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
            return fn(*args, **kwargs)
        return wrapper
    return wrap


def die(phase):
    print(f"fault: rank {rank} (pid {os.getpid()}) SIGKILLed in {phase}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def half_written_save(save):
    """torch.save that writes half the bytes of step 4's checkpoint and dies (for phase save)."""
    def wrapper(obj, f, *args, **kwargs):
        if kill_phase == "save" and rank == int(kill_rank) and ".ckpt-000000004.pt." in str(getattr(f, "name", "")):
            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
            f.flush()
            die("save")
        return save(obj, f, *args, **kwargs)
    return wrapper


trainer.init_distributed = fault("rendezvous")(trainer.init_distributed)
trainer.Trainer._resume = fault("checkpoint")(trainer.Trainer._resume)
wrap.data_parallel = fault("ddp")(wrap.data_parallel)
trainer.evaluate = fault("eval")(trainer.evaluate)
trainer.Trainer._prepare = fault("data", on_call=5)(trainer.Trainer._prepare)
step = hpcdl.train.step.Stepper.step
hpcdl.train.step.Stepper.step = fault("step3", on_call=3)(fault("first_step")(step))
hpcdl.distributed.gradients.ddp._timed = fault("allreduce", on_call=9)(hpcdl.distributed.gradients.ddp._timed)  # a bucket of step 5 (2 a step)
watch = hpcdl.distributed.gradients.ddp.CommTimer.watch


def watch_with_fault(timer, model):
    """Hook none has no comm hook (DDP's own all-reduce): the fault comes half-way through step 5's gradients, after
    the first bucket (the last layers', ready first) was handed to its all-reduce."""
    watch(timer, model)
    params = [p for p in model.parameters() if p.requires_grad]
    hit = fault("allreduce", on_call=4 * len(params) + len(params) // 2)(lambda p: None)
    for p in params:
        p.register_post_accumulate_grad_hook(hit)


hpcdl.distributed.gradients.ddp.CommTimer.watch = watch_with_fault
hpcdl.optim.shard.ShardedOptimizer.gather = fault("gather", on_call=5)(hpcdl.optim.shard.ShardedOptimizer.gather)
criterion = build.make_criterion
build.make_criterion = lambda smoothing: fault("forward", on_call=5)(criterion(smoothing))
checkpoint.torch.save = half_written_save(checkpoint.torch.save)
console(sys.argv[1:])
