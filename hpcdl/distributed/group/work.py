"""The Works hpcdl's own groups return: a collective queued on the communication thread (:class:`FutureWork`), or
already run on the caller's thread (:class:`DoneWork`), and the chaining that lets DDP's C++ reducer read a
failure raised in Python (:func:`unwrapped`)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.futures import Future

__all__ = ["DoneWork", "FutureWork", "unwrapped"]


class FutureWork(dist.Work):
    """The Work of a collective queued on a communication thread: done when the thread completes its future."""

    def __init__(self, future: Future):
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._future.wait()  # raises the collective's error
        return True

    def get_future(self) -> Future:
        """The future a C++ caller reads (DDP's reducer, with no comm hook): chained, so that a failure is the
        future's error rather than a result holding a Python exception, which the reducer cannot read ("Expected
        TensorList but got PyObject") and would report instead of the collective's own message."""
        return self._future.then(unwrapped)

    def is_completed(self) -> bool:
        return self._future.done()


def unwrapped(future: Future):
    """A future set from Python carries an error as a Python object that DDP's C++ reducer cannot read ("Unable to
    cast ... to Tensor"); raising it in a ``then`` callback makes it the chained future's error, which DDP raises
    from backward like a C++ collective's."""
    return future.value()


class DoneWork(dist.Work):
    """The Work of a collective that already ran on the caller's thread; its future is made on demand."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        return True
