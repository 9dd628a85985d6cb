"""One rank of test_preempt: step until the ranks agree to stop; report the step it stopped at."""

import json
import os
import sys
import time

import torch.distributed as dist

from hpcdl.train.preempt import StopSignal

out = sys.argv[1]
dist.init_process_group("gloo")
stop = StopSignal("USR2")
with open(os.path.join(out, f"ready{dist.get_rank()}"), "w") as f:
    f.write(str(os.getpid()))
step = 0
while not stop.agreed() and step < 100000:
    step += 1
    time.sleep(0.01 if dist.get_rank() == 0 else 0.02)  # ranks run at different speeds
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"step": step, "seen": stop.seen}, f)
dist.destroy_process_group()
