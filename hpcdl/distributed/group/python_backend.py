"""The torch side of hpcdl's own process groups: a torch ``Backend`` whose collectives a communication library
called from Python runs on a :class:`~hpcdl.distributed.group.comm_thread.CommThread`.

torch's wheels carry gloo only. hpcdl reaches other libraries (MPI through mpi4py, oneCCL through its C
API) with a torch backend written in Python; this module is what they share, so that a library is one small
file of primitives (see :class:`ThreadedProcessGroup`).

Collectives are asynchronous: each call queues the operation for the group's thread and returns a
:class:`torch.distributed.Work` at once, whose future the thread completes. A small collective (at most the
group's ``inline_bytes``) issued while nothing is queued may run on the caller's thread instead, which saves
two thread hand-offs (the small-message latency); a library that must be called from one thread only
(oneCCL) sets ``inline_bytes = 0``. A collective that does not complete within its group's timeout fails
its Work with a message that names this rank, the library and the operation; the caller
(``hpcdl.distributed.group.liveness.fail_fast``) then names the lost rank from the heartbeats.

The base also does what every library needs around its primitives: AVG as a sum divided by the size,
reductions of dtypes the library lacks in fp32, non-contiguous tensors, the list and ``_single`` forms
of the collectives torch calls, and an unsupported reduce op refused with the same clear error.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from hpcdl.distributed.group.comm_thread import CommThread, Liveness, describe
from hpcdl.distributed.group.work import DoneWork, FutureWork, unwrapped
from hpcdl.errors import ConfigError

# CommThread, Liveness, DoneWork, unwrapped: for the libraries
__all__ = ["CommThread", "DoneWork", "Liveness", "ThreadedProcessGroup", "library_group", "unwrapped"]

_SUM, _AVG = dist.ReduceOp.RedOpType.SUM, dist.ReduceOp.RedOpType.AVG
_PREMUL = dist.ReduceOp.RedOpType.PREMUL_SUM
_OPS = {"SUM": dist.ReduceOp.RedOpType.SUM, "AVG": _AVG, "MAX": dist.ReduceOp.RedOpType.MAX,
        "MIN": dist.ReduceOp.RedOpType.MIN, "PRODUCT": dist.ReduceOp.RedOpType.PRODUCT}


def library_group(group=None) -> "ThreadedProcessGroup | None":
    """The hpcdl backend behind ``group`` (default: the world), or ``None`` for torch's own (gloo)."""
    if isinstance(group, ThreadedProcessGroup):
        return group
    pg = dist.group.WORLD if group is None else group
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):  # no CPU backend, or not a member (a placeholder)
        return None
    return backend if isinstance(backend, ThreadedProcessGroup) else None


def _python_backend_base() -> type:
    """torch's C++ ``Backend`` where Python may subclass it (torch 2.14 here); ``ProcessGroup`` where its
    binding has no Python constructor (torch 2.8, which IPEX needs)."""
    base = torch._C._distributed_c10d.Backend

    class Probe(base):
        pass

    try:
        Probe(0, 1)
    except TypeError:  # "No constructor defined!"
        return dist.ProcessGroup
    return base


class ThreadedProcessGroup(_python_backend_base()):
    """A torch.distributed backend whose collectives a library runs on a :class:`CommThread`. torch wraps it in
    a ``ProcessGroup`` with the CPU as its device (as it does gloo), so what asks a group for its backend by
    device (``batch_isend_irecv``, FSDP, torch's object collectives) finds it; :func:`library_group` does too.
    On a torch whose ``Backend`` Python cannot subclass, it is a ``ProcessGroup`` itself, and
    ``batch_isend_irecv`` cannot find it.

    A library subclasses it with its name (``BACKEND_NAME``, ``LIBRARY``), the dtypes it reduces
    (``NATIVE``; others are reduced in fp32 and copied back), its reduce ops (``library_op``), and six
    primitives on contiguous CPU tensors, each run on the thread (or inline when ``inline`` is true):
    ``_allreduce(buf, op)``, ``_reduce(buf, op, root)`` (in place on the root), ``_broadcast(buf, root)``,
    ``_allgather(send, recv)`` (``recv`` holds every rank's ``send`` in rank order; ``send`` None where the library
    sets ``IN_PLACE_ALLGATHER``: its part is in ``recv``), ``_reduce_scatter(send, recv, op)``, ``_barrier()``.
    """

    BACKEND_NAME = ""
    LIBRARY = ""
    NATIVE: frozenset = frozenset()
    IN_PLACE_ALLGATHER = False
    inline_bytes = 0
    # torch's binding of the C++ property recurses forever on a Python subclass that does not override it
    # (batch_isend_irecv reads it): no NCCL-style coalescing here.
    supports_coalescing = False

    def __init__(self, rank: int, world_size: int, timeout: timedelta, thread: CommThread):
        super().__init__(rank, world_size)
        self.timeout, self.thread = timeout, thread

    def getBackendName(self) -> str:
        return self.BACKEND_NAME

    def set_timeout(self, timeout: timedelta) -> None:
        """``dist.set_timeout(timeout, group)`` (torch >= 2.9): the watchdog reads it from the next collective."""
        self.timeout = timeout

    def name(self) -> str:
        return self.BACKEND_NAME

    def library_op(self, name: str):
        """The library's reduce op for ``name`` (SUM, MAX, MIN, PRODUCT); ``None`` if it has none."""
        raise NotImplementedError

    def failed(self, what, exc: Exception) -> Exception:
        """The error a Work carries when the library call for ``what`` raised ``exc`` (one that names this rank
        and the collective already, as it is)."""
        if isinstance(exc, dist.DistBackendError):
            return exc
        return dist.DistBackendError(f"rank {self.rank()}: {self.LIBRARY} {describe(what)} failed: {exc}")

    def timed_out(self) -> str:
        return f"did not complete within {self.timeout}; a peer rank is gone or stuck"

    # -- queueing -------------------------------------------------------------------------------------------
    def _submit(self, fn, what, nbytes: int) -> dist.Work:
        """Run ``fn(inline)``, which makes the library calls, and return its Work.

        It runs here (``inline=True``) when it is small and the thread has nothing queued, so that
        collectives still reach the library in the order they were issued. Otherwise it is queued and the
        Work completes when the thread has run it (``inline=False``; failed by the watchdog on a timeout).
        """
        thread = self.thread
        with thread.lock:
            if nbytes <= self.inline_bytes and not thread.queued:
                try:
                    return DoneWork(fn(True))
                except Exception as exc:  # delivered by the Work, as from the thread
                    failed: Future = Future()
                    failed.set_exception(dist.DistBackendError(f"rank {self.rank()}: {self.LIBRARY} {describe(what)} "
                                                               + self.timed_out()) if isinstance(exc, TimeoutError)
                                         else self.failed(what, exc))
                    return FutureWork(failed)
            thread.count(1)
        future: Future = Future()
        thread.put(fn, future, self, what)
        return FutureWork(future)

    # -- what every library needs around its primitives -----------------------------------------------------
    @functools.cached_property
    def _sum(self):
        return self.library_op("SUM")

    def _op(self, opts) -> tuple[bool | float, object]:
        """(what to do around the library's reduction, the library's op) for ``opts.reduceOp``: ``False``
        nothing, ``True`` divide the result by the size (AVG), a number: multiply each input by it first
        (PREMUL_SUM, which torch's FSDP and ``_make_nccl_premul_sum`` use)."""
        op = opts.reduceOp.op
        if op == _SUM:  # the common case, without a lookup by name (a microsecond of a small message's latency)
            return False, self._sum
        if op == _PREMUL:
            factor = opts.reduceOp.factor
            if not isinstance(factor, float):
                raise ConfigError(f"backend {self.BACKEND_NAME}: PREMUL_SUM by a tensor factor is not supported; "
                                  "pass a number to _make_nccl_premul_sum")
            return factor, self._sum
        name = "SUM" if op == _AVG else next((k for k, v in _OPS.items() if v == op), str(op))
        library_op = self.library_op(name)
        if library_op is None:
            raise ConfigError(f"backend {self.BACKEND_NAME}: reduce op {op} is not supported; use SUM, AVG, MAX, MIN, "
                              "PRODUCT or PREMUL_SUM")
        return op == _AVG, library_op

    def _before(self, buf: torch.Tensor, around, owned: bool) -> torch.Tensor:
        """PREMUL_SUM's multiplication of the input (on a copy unless ``owned``: an input stays as given)."""
        if around is True or around is False:
            return buf
        return buf.mul_(around) if owned else buf * around

    def _reducible(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(a contiguous tensor of a dtype the library reduces, whether to copy it back into ``tensor``)."""
        if tensor.dtype not in self.NATIVE:
            return tensor.float(), True
        if tensor.is_contiguous():
            return tensor, False
        return tensor.contiguous(), True

    def _divide(self, buf: torch.Tensor) -> None:
        """AVG's division; an integer mean is truncated toward zero, as Lightning's gloo path does (its
        ``sync_dist`` averages integer counters with AVG on any other backend)."""
        if buf.is_floating_point():
            buf.div_(self.size())
        else:
            buf.copy_(buf.div(self.size(), rounding_mode="trunc"))

    # -- collectives ----------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        around, op = self._op(opts)

        def run(inline):
            for t in tensors:
                buf, back = self._reducible(t)
                buf = self._before(buf, around, owned=True)  # all-reduce overwrites it anyway
                self._allreduce(buf, op, inline)
                if around is True:
                    self._divide(buf)
                if back:
                    t.copy_(buf)
            return tensors

        return self._submit(run, ("allreduce", tensors), _nbytes(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        (around, op), root = self._op(opts), opts.rootRank

        def run(inline):
            for t in tensors:
                buf, back = self._reducible(t)
                buf = self._before(buf, around, owned=True)
                self._reduce(buf, op, root, inline)
                if self.rank() == root:
                    if around is True:
                        self._divide(buf)
                    if back:
                        t.copy_(buf)
            return tensors

        return self._submit(run, ("reduce", tensors), _nbytes(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts) -> dist.Work:
        root = opts.rootRank

        def run(inline):
            for t in tensors:
                buf = t if t.is_contiguous() else t.contiguous()
                self._broadcast(buf, root, inline)
                if buf is not t:
                    t.copy_(buf)
            return tensors

        return self._submit(run, f"broadcast from rank {root}", _nbytes(tensors))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        def run(inline):
            for outs, inp in zip(outputs, inputs):
                flat = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
                self._allgather(inp.contiguous(), flat, inline)
                for r, out in enumerate(outs):
                    out.copy_(flat[r])
            return outputs

        return self._submit(run, "allgather", _nbytes(inputs) * self.size())

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> dist.Work:
        # inp may be this rank's part of output (in place, as NCCL's): optimizer.shard's all-gather into the weights
        in_place = output.is_contiguous() and inp.is_contiguous() and output.nbytes == inp.nbytes * self.size() \
            and inp.data_ptr() == output.data_ptr() + self.rank() * inp.nbytes

        def run(inline):
            recv = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
            self._allgather(inp.contiguous() if not in_place else None if self.IN_PLACE_ALLGATHER else inp.clone(),
                            recv, inline)
            if recv is not output:
                output.copy_(recv)
            return [output]

        return self._submit(run, "allgather", _nbytes([output]))

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts) -> dist.Work:
        around, op = self._op(opts)

        def run(inline):
            send, copied = self._reducible(inp)
            send = self._before(send, around, owned=copied)
            direct = output.is_contiguous() and output.dtype == send.dtype  # else received apart, then copied
            recv = output if direct else torch.empty(output.shape, dtype=send.dtype)
            self._reduce_scatter(send, recv, op, inline)
            if around is True:
                self._divide(recv)
            if not direct:
                output.copy_(recv)
            return [output]

        return self._submit(run, "reduce_scatter", _nbytes([inp]))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts) -> dist.Work:
        for out, ins in zip(outputs, inputs):
            self._reduce_scatter_base(out, torch.stack(ins), opts).wait()
        return DoneWork(outputs)

    # torch >= 2.10 names the flat variants *_single; earlier releases call the *_base ones.
    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> dist.Work:
        return self._allgather_base(output, inp, opts)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts) -> dist.Work:
        return self._reduce_scatter_base(output, inp, opts)

    def barrier(self, opts=None) -> dist.Work:
        return self._submit(lambda inline: self._barrier(inline), "barrier", 0)

    # Built on the primitives above, as every rank's data passes through each rank: what scripts and torch's
    # object collectives call, at the cost of moving size x the bytes (none of them is on a training step's
    # path; DDP and the hooks use all-reduce).
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts) -> dist.Work:
        root = opts.rootRank

        def run(inline):
            inp = inputs[0].contiguous()
            flat = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
            self._allgather(inp, flat, inline)
            if self.rank() == root:
                for r, out in enumerate(outputs[0]):
                    out.copy_(flat[r])
            return outputs[0] if self.rank() == root else []

        return self._submit(run, f"gather to rank {root}", _nbytes(inputs) * self.size())

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts) -> dist.Work:
        root = opts.rootRank

        def run(inline):
            out = outputs[0]
            flat = (torch.stack([t.reshape(out.shape) for t in inputs[0]]) if self.rank() == root
                    else torch.empty((self.size(), *out.shape), dtype=out.dtype))
            self._broadcast(flat, root, inline)
            out.copy_(flat[self.rank()])
            return outputs

        return self._submit(run, f"scatter from rank {root}", _nbytes(outputs) * self.size())

    def alltoall_base(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts=None) -> dist.Work:
        n = self.size()
        if output_split_sizes or input_split_sizes:
            if len(set(output_split_sizes)) > 1 or len(set(input_split_sizes)) > 1:
                raise ConfigError(f"backend {self.BACKEND_NAME}: all_to_all_single with uneven split sizes is not "
                                  "supported; pad to equal splits, or use a gloo group (dist.new_group(backend='gloo'))")
        if inp.shape[0] % n or inp.shape != output.shape:
            raise ConfigError(f"backend {self.BACKEND_NAME}: all_to_all_single needs input and output of one shape "
                              f"whose first dimension divides by the group's {n} ranks; got {tuple(inp.shape)} and "
                              f"{tuple(output.shape)}")

        def run(inline):
            every = torch.empty((n, *inp.shape), dtype=inp.dtype)  # every rank's whole input
            self._allgather(inp.contiguous(), every, inline)
            mine = every.reshape(n, n, -1)[:, self.rank()]  # what each rank sends to this one, in rank order
            output.copy_(mine.reshape(output.shape))
            return [output]

        return self._submit(run, "all_to_all", _nbytes([inp]) * n)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts=None) -> dist.Work:  # torch >= 2.10's name
        return self.alltoall_base(output, inp, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        if len({t.shape for t in (*inputs, *outputs)}) > 1:
            raise ConfigError(f"backend {self.BACKEND_NAME}: all_to_all with tensors of different shapes is not "
                              "supported; use one shape, or a gloo group (dist.new_group(backend='gloo'))")
        flat_out = torch.empty((len(outputs), *outputs[0].shape), dtype=outputs[0].dtype)
        work = self.alltoall_base(flat_out, torch.stack(inputs), [], [], opts)
        work.wait()
        for out, got in zip(outputs, flat_out):
            out.copy_(got)
        return DoneWork(outputs)

    def _point_to_point(self, what: str):
        raise ConfigError(f"backend {self.BACKEND_NAME}: {what} (point-to-point) is not supported: its library is "
                          "called from one communication thread in issue order, where a receive would block the "
                          "collectives behind it. Send through a gloo group beside it: "
                          "dist.new_group(backend='gloo')")

    def send(self, tensors, dst: int, tag: int = 0) -> dist.Work:
        self._point_to_point("send")

    def recv(self, tensors, src: int, tag: int = 0) -> dist.Work:
        self._point_to_point("recv")

    def recv_anysource(self, tensors, tag: int = 0) -> dist.Work:
        self._point_to_point("recv from any source")

    # -- the library's primitives ---------------------------------------------------------------------------
    def _allreduce(self, buf: torch.Tensor, op, inline: bool) -> None:
        raise NotImplementedError

    def _reduce(self, buf: torch.Tensor, op, root: int, inline: bool) -> None:
        raise NotImplementedError

    def _broadcast(self, buf: torch.Tensor, root: int, inline: bool) -> None:
        raise NotImplementedError

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor, inline: bool) -> None:
        raise NotImplementedError

    def _reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, op, inline: bool) -> None:
        raise NotImplementedError

    def _barrier(self, inline: bool) -> None:
        raise NotImplementedError


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return tensors[0].nbytes if len(tensors) == 1 else sum(t.nbytes for t in tensors)
