"""A training script of the kind PyTorch's DDP tutorial gives: it imports torch only, never hpcdl.

    python plain_ddp.py BACKEND OUT.json     (under torchrun, or 'srun hpcdl exec python plain_ddp.py ...')

``init_process_group(BACKEND)`` finds hpcdl's groups (``oneccl``, ``mpi4py``) through torch's entry points.
Each collective that scripts and libraries call is checked against exact values; one that the backend
refuses is recorded with torch's message. Then 20 DDP steps of a small model; rank 0 writes the results
and the final weights (as lists) to OUT.json.
"""

import json
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def collectives(rank: int, world: int) -> dict[str, str]:
    """name -> "ok", or the error a refused operation raised (a wrong value fails the script)."""
    results = {}

    def check(name, fn):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the old names still work, with a warning
                fn()
            results[name] = "ok"
        except AssertionError:
            raise
        except Exception as exc:  # a refusal: recorded, and the test reads its message
            results[name] = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:300]

    base = torch.arange(4, dtype=torch.float32) + 1  # 1 2 3 4

    def all_reduce():
        for op, want in ((dist.ReduceOp.SUM, base * sum(r + 1 for r in range(world))),
                         (dist.ReduceOp.MAX, base * world), (dist.ReduceOp.MIN, base),
                         (dist.ReduceOp.AVG, base * sum(r + 1 for r in range(world)) / world)):
            t = base * (rank + 1)
            dist.all_reduce(t, op=op)
            assert torch.equal(t, want), (op, t, want)
        t = torch.full((3,), rank + 2, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
        assert t.tolist() == [2 * 3] * 3 if world == 2 else True, t

    def premul_sum():
        t = base * (rank + 1)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        assert torch.equal(t, base * sum(r + 1 for r in range(world)) * 0.5), t

    def int_avg():  # truncated toward zero, as Lightning averages its integer counters on gloo
        t = torch.tensor([rank + 3, -(rank + 3)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        total = sum(r + 3 for r in range(world))
        assert t.tolist() == [int(total / world), -int(total / world)], t

    def broadcast():
        t = base * (rank + 1)
        dist.broadcast(t, src=world - 1)
        assert torch.equal(t, base * world), t

    def reduce():
        t = base * (rank + 1)
        dist.reduce(t, dst=0)
        if rank == 0:
            assert torch.equal(t, base * sum(r + 1 for r in range(world))), t

    def all_gather():
        out = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(out, base * (rank + 1))
        assert all(torch.equal(o, base * (r + 1)) for r, o in enumerate(out)), out

    def all_gather_into_tensor(fn):
        def run():
            out = torch.zeros(4 * world)
            fn(out, base * (rank + 1))
            assert torch.equal(out, torch.cat([base * (r + 1) for r in range(world)])), out
        return run

    def reduce_scatter_tensor(fn):
        def run():
            out = torch.zeros(2)
            fn(out, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
            want = torch.arange(2 * world, dtype=torch.float32)[2 * rank:2 * rank + 2] * sum(r + 1 for r in range(world))
            assert torch.equal(out, want), out
        return run

    def reduce_scatter():
        out = torch.zeros(4)
        dist.reduce_scatter(out, [base * (rank + 1) * (r + 1) for r in range(world)])
        assert torch.equal(out, base * (rank + 1) * sum(r + 1 for r in range(world))), out

    def gather():
        out = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
        dist.gather(base * (rank + 1), out, dst=0)
        if rank == 0:
            assert all(torch.equal(o, base * (r + 1)) for r, o in enumerate(out)), out

    def scatter():
        out = torch.zeros(4)
        dist.scatter(out, [base * (r + 1) for r in range(world)] if rank == 0 else None, src=0)
        assert torch.equal(out, base * (rank + 1)), out

    def all_to_all_single():
        inp = torch.arange(world, dtype=torch.float32) + 10 * rank  # element j goes to rank j
        out = torch.zeros(world)
        dist.all_to_all_single(out, inp)
        assert out.tolist() == [10 * r + rank for r in range(world)], out

    def all_to_all():
        out = [torch.zeros(2) for _ in range(world)]
        dist.all_to_all(out, [torch.full((2,), 10.0 * rank + j) for j in range(world)])
        assert [o.tolist() for o in out] == [[10.0 * r + rank] * 2 for r in range(world)], out

    def send_recv():
        if rank == 0:
            dist.send(base * 7, dst=1)
        elif rank == 1:
            t = torch.zeros(4)
            dist.recv(t, src=0)
            assert torch.equal(t, base * 7), t

    def batch_isend_irecv():
        peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
        got = torch.zeros(4)
        ops = [dist.P2POp(dist.isend, base * (rank + 1), peer_to), dist.P2POp(dist.irecv, got, peer_from)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        assert torch.equal(got, base * (peer_from + 1)), got

    def objects():
        objs = [{"rank": rank}, "x"] if rank == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0)
        assert objs == [{"rank": 0}, "x"], objs
        gathered = [None] * world
        dist.all_gather_object(gathered, ("r", rank))
        assert gathered == [("r", r) for r in range(world)], gathered
        at0 = [None] * world if rank == 0 else None
        dist.gather_object({"r": rank}, at0, dst=0)
        if rank == 0:
            assert at0 == [{"r": r} for r in range(world)], at0
        mine = [None]
        dist.scatter_object_list(mine, [f"to {r}" for r in range(world)] if rank == 0 else None, src=0)
        assert mine == [f"to {rank}"], mine

    def groups():
        sub = dist.new_group(list(range(world)))
        t = base * (rank + 1)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, base * sum(r + 1 for r in range(world))), t
        mine, _ = dist.new_subgroups(group_size=1)
        t = base * (rank + 1)
        dist.all_reduce(t, group=mine)
        assert torch.equal(t, base * (rank + 1)), t

    def set_timeout():  # torch >= 2.9's name for the deprecated _set_pg_timeout
        dist.set_timeout(timedelta(minutes=5))
        dist.barrier()

    def backend_name():
        name = dist.get_backend()
        assert name == sys.argv[1], (name, sys.argv[1])  # what was asked for, "cpu:oneccl" included

    if sys.argv[1].endswith("gloo"):  # gloo refuses these (asynchronously, failing the next collective)
        premul_sum = int_avg = None
    for name, fn in (("all_reduce", all_reduce), ("premul_sum", premul_sum), ("int_avg", int_avg),
                     ("broadcast", broadcast),
                     ("reduce", reduce), ("all_gather", all_gather),
                     ("all_gather_into_tensor", all_gather_into_tensor(dist.all_gather_into_tensor)),
                     ("all_gather_single", all_gather_into_tensor(getattr(dist, "all_gather_single",
                                                                          dist.all_gather_into_tensor))),
                     ("reduce_scatter_tensor", reduce_scatter_tensor(dist.reduce_scatter_tensor)),
                     ("reduce_scatter_single", reduce_scatter_tensor(getattr(dist, "reduce_scatter_single",
                                                                             dist.reduce_scatter_tensor))),
                     ("reduce_scatter", reduce_scatter), ("gather", gather), ("scatter", scatter),
                     ("all_to_all_single", all_to_all_single), ("all_to_all", all_to_all),
                     ("send_recv", send_recv), ("batch_isend_irecv", batch_isend_irecv), ("objects", objects),
                     ("barrier", dist.barrier), ("new_group", groups), ("set_timeout", set_timeout),
                     ("backend_name", backend_name)):
        if fn is None:
            results[name] = "skipped"
            continue
        check(name, fn)
        dist.barrier()  # a refusal on one rank must not leave the other inside the next collective
    return results


def train(steps: int = 20) -> dict[str, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def second_init(backend: str, rank: int, world: int) -> str:
    """``init_process_group`` again after ``destroy_process_group``, one all-reduce, destroyed again. Not under
    torchrun: its agent's store does not take a second rendezvous, and hangs with gloo too."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "skipped"
    # a new rendezvous port: the first store stays bound while anything still holds the first group (gloo too)
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    dist.init_process_group(backend)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    expected = float(world * (world + 1) // 2)
    return "ok" if t.tolist() == [expected] * 3 else f"wrong: {t.tolist()} instead of {expected}"


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    before = "hpcdl" in sys.modules
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = collectives(rank, world)
    weights = train()
    dist.barrier()
    dist.destroy_process_group()
    results["second_init"] = second_init(backend, rank, world)
    if rank == 0:
        with open(out + ".tmp", "w") as f:
            json.dump({"backend": backend, "world": world, "hpcdl_before_init": before,
                       "hpcdl_after_init": "hpcdl" in sys.modules, "collectives": results, "weights": weights}, f)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
