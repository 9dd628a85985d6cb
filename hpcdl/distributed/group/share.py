"""Rank 0 reads, every rank gets it: one read of a shared file per job, whatever the number of ranks.

:func:`from_rank0` runs a reader on rank 0 and hands its result, or its error, to every rank of the group
(the manifests, a fine-tuning checkpoint's verdict). :func:`broadcast_state` does the same for a state of
any size, a checkpoint's: its tensors are streamed through a staging buffer of ``chunk_bytes`` (64 MiB by
default) rather than pickled whole, so that

- every call stays far below the 2 GiB count of a 32-bit ``int`` (mpi4py 3.x and MPI 3 take one buffer's
  count as an ``int``: a pickled 3.6 GB checkpoint overflowed it);
- each rank holds one copy of the state plus one chunk: rank 0 its loaded tensors, the others the tensors
  they receive into (``broadcast_object_list`` of the file's bytes held the bytes, their pickle, a tensor of
  the pickle and the loaded state: 4-5x the checkpoint on rank 0, 3-4x on the others).

Only the state's skeleton (its nesting, numbers, strings, tensors' dtypes and shapes) is pickled.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from hpcdl import errors

__all__ = ["CHUNK_BYTES", "broadcast_state", "from_rank0"]

T = TypeVar("T")
CHUNK_BYTES = 64 << 20


def from_rank0(read: Callable[[], T], group, what: str, *, catch: tuple[type[Exception], ...] = (errors.HpcdlError,)
               ) -> T:
    """Collective: ``read()`` on rank 0, its result on every rank. An exception of the types in ``catch`` that
    rank 0 raises reaches every rank as the same type: rank 0 raises its own, the others one that says rank 0
    could not ``what``. ``OSError`` in ``catch`` arrives as :class:`hpcdl.errors.DataError`."""
    found: list = [None, None, None]  # result, error type's name, error text
    if dist.get_rank(group) == 0:
        try:
            found[0] = read()
        except catch as exc:
            found[1:] = [_error_name(exc), str(exc)]
            mine = exc
    dist.broadcast_object_list(found, src=0, group=group)
    if found[1] is not None:
        if dist.get_rank(group) == 0:
            raise mine
        raise getattr(errors, found[1])(f"rank 0 could not {what}: {found[2]}")
    return found[0]


def _error_name(exc: Exception) -> str:
    for kind in type(exc).__mro__:
        if isinstance(getattr(errors, kind.__name__, None), type):
            return kind.__name__
    return "DataError"  # OSError and the like: a file rank 0 could not read


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """Where a tensor was in a state: its place in the stream, dtype and shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def broadcast_state(state, group, *, chunk_bytes: int = CHUNK_BYTES, src: int = 0):
    """Collective: rank ``src``'s ``state`` (dicts, lists and tuples of tensors and plain values; ``src`` is a rank
    of ``group``) on every rank; the others pass anything (None) and get a copy whose tensors are fresh, contiguous
    CPU tensors. Tensors that shared storage on rank ``src`` arrive as separate tensors."""
    root = dist.get_rank(group) == src
    src = src if group is None else dist.get_global_rank(group, src)  # what torch < 2.6 takes (no group_src)
    tensors: list[torch.Tensor] = []
    skeleton = [_hollow(state, tensors) if root else None]
    dist.broadcast_object_list(skeleton, src=src, group=group)
    if not root:
        state = _fill(skeleton[0], tensors)
    _stream([_bytes(t) for t in tensors], root, group, chunk_bytes, src)
    return state


def _hollow(tree, tensors: list[torch.Tensor]):
    """``tree`` with each tensor replaced by its slot; the tensors appended to ``tensors``, contiguous."""
    if torch.is_tensor(tree):
        tensors.append(tree.detach().cpu().contiguous())
        return _Slot(len(tensors) - 1, tree.dtype, tuple(tree.shape))
    if isinstance(tree, dict):
        return {k: _hollow(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_hollow(v, tensors) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _fill(tree, tensors: list[torch.Tensor]):
    """The inverse of :func:`_hollow` on a receiving rank: an empty tensor for each slot, in stream order."""
    if isinstance(tree, _Slot):
        tensors.append(torch.empty(tree.shape, dtype=tree.dtype))
        return tensors[-1]
    if isinstance(tree, dict):
        return {k: _fill(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_fill(v, tensors) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _stream(views: list[torch.Tensor], root: bool, group, chunk_bytes: int, src: int = 0) -> None:
    """Broadcast the concatenation of ``views`` (flat byte tensors) from global rank ``src`` in chunks of
    ``chunk_bytes``: small tensors share a chunk, a large one spans several. The root copies its bytes into the
    staging buffer, the others copy out of it."""
    total = sum(v.numel() for v in views)
    if not total:
        return
    staging = torch.empty(min(chunk_bytes, total), dtype=torch.uint8)
    pending: list[tuple[torch.Tensor, int, int, int]] = []  # (view, offset in it, in staging, bytes): this chunk
    filled, i, offset = 0, 0, 0
    while i < len(views):
        view = views[i]
        n = min(view.numel() - offset, staging.numel() - filled)
        if n:
            if root:
                staging[filled:filled + n].copy_(view[offset:offset + n])
            pending.append((view, offset, filled, n))
        filled, offset = filled + n, offset + n
        if offset == view.numel():
            i, offset = i + 1, 0
        if filled == staging.numel() or (i == len(views) and filled):
            dist.broadcast(staging[:filled], src=src, group=group)
            if not root:
                for dest, at, start, n in pending:
                    dest[at:at + n].copy_(staging[start:start + n])
            pending, filled = [], 0
