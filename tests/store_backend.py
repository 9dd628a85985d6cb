"""A third backend in one file and one table row, as docs/communication.md says it takes: collectives through
the job's rendezvous store (each rank sets its bytes under a key, reads everyone's, reduces them itself).
Slow, and for the test of that claim only (``group_ranks.py OUT store``); importing it adds the row."""

import torch
import torch.distributed as dist

from hpcdl.distributed.backend import BACKENDS, Backend
from hpcdl.distributed.group.python_backend import CommThread, ThreadedProcessGroup

_REDUCE = {"SUM": lambda s: s.sum(0), "MAX": lambda s: s.amax(0), "MIN": lambda s: s.amin(0),
           "PRODUCT": lambda s: s.prod(0)}


class StoreProcessGroup(ThreadedProcessGroup):
    BACKEND_NAME, LIBRARY = "hpcdl-store", "store"
    NATIVE = frozenset({torch.float32, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.int16})

    def __init__(self, rank, size, timeout, store, liveness=None):
        super().__init__(rank, size, timeout, CommThread("hpcdl-store", liveness=liveness))
        self.store, self.seq = store, 0

    def library_op(self, name):
        return _REDUCE.get(name)

    def _exchange(self, t: torch.Tensor | None) -> list[torch.Tensor]:
        """Every rank's bytes of ``t`` (None: nothing to give), as uint8 tensors in rank order."""
        key, self.seq = f"x{self.seq}/", self.seq + 1
        self.store.set(key + str(self.rank()), b"" if t is None else t.view(torch.uint8).numpy().tobytes())
        parts = [self.store.get(key + str(r)) for r in range(self.size())]
        return [torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else torch.empty(0, dtype=torch.uint8)
                for p in parts]

    def _reduced(self, buf, op):
        return op(torch.stack([p.view(buf.dtype) for p in self._exchange(buf)])).view(buf.shape)

    def _allreduce(self, buf, op, inline):
        buf.copy_(self._reduced(buf, op))

    def _reduce(self, buf, op, root, inline):
        out = self._reduced(buf, op)
        if self.rank() == root:
            buf.copy_(out)

    def _broadcast(self, buf, root, inline):
        buf.view(torch.uint8).view(-1).copy_(self._exchange(buf if self.rank() == root else None)[root])

    def _allgather(self, send, recv, inline):
        recv.view(torch.uint8).view(self.size(), -1).copy_(torch.stack(self._exchange(send)))

    def _reduce_scatter(self, send, recv, op, inline):
        recv.copy_(self._reduced(send, op).view(self.size(), -1)[self.rank()].view(recv.shape))

    def _barrier(self, inline):
        self._exchange(None)


def register(liveness=None):
    if "hpcdl-store" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hpcdl-store", lambda o, _=None: StoreProcessGroup(
            o.group_rank, o.group_size, o.timeout, o.store, liveness), extended_api=True, devices=["cpu"])


def describe(lib=None) -> str:
    return "the rendezvous store"


BACKENDS["store"] = Backend("store", "hpcdl-store", "store_backend:describe", "store_backend:register")
