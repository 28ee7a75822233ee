"""Tensor subclasses as parameters: cut into shards with the few operations FSDP2 uses.

[Note: sharding a tensor subclass]
Low-precision weights are tensor subclasses (torchao's ``NF4Tensor`` for QLoRA, float8
training's ``WeightWithDynamicFloat8CastTensor``) that implement a handful of operations on
their inner tensors, not every ATen operation. FSDP2 shards such a parameter with exactly these:
``torch.chunk`` along dim 0 (``split``), ``new_zeros`` of the chunk's shape and ``copy_`` into a
zero-offset ``narrow`` of it -- NF4 refuses a ``narrow`` or a slice at any other offset, and its
``clone`` quantizes again. :func:`cut` takes a subclass's shard the same way (a fresh tensor
the full one can be freed after), and a subclass that lacks one of them gets an error naming
the parameter and the operation. ``speaks`` tells the subclasses that put their own bytes on
the wire (FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, see ``_packed``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._runtime._mode import transformed
from ._dtensor import unwrap


def is_subclass(x: torch.Tensor) -> bool:
    """``x`` is a wrapper tensor subclass (inner tensors, ``__tensor_flatten__``) other than
    DTensor: a low-precision weight, say."""
    return type(x) is not torch.Tensor and is_traceable_wrapper_subclass(x) and not _dtensor(x)


def speaks(x: torch.Tensor) -> bool:
    """``x`` implements FSDP2's all-gather protocol (both hooks).

    Raises:
        TypeError: it implements one of the two hooks only (as FSDP2 refuses it).
    """
    cls = type(x)
    if cls is torch.Tensor:
        return False
    pre, post = hasattr(cls, "fsdp_pre_all_gather"), hasattr(cls, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(
            f"{cls.__name__} defines {'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} "
            "but not the other; FSDP2's all-gather protocol needs both."
        )
    return pre


def speaking(tensors: Sequence[torch.Tensor]) -> tuple[bool, ...] | None:
    """Per tensor, :func:`speaks`; ``None`` when none does (the common case, checked by type).
    Inside ``torch.func`` transforms, of the tensors under their wrappers."""
    if all(type(t) is torch.Tensor for t in tensors):
        if not transformed():
            return None
        tensors = [unwrap(t) for t in tensors]
    flags = tuple(speaks(t) for t in tensors)
    return flags if any(flags) else None


def inner(x: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors under ``x`` (``x`` itself if it is plain), through nested subclasses."""
    if not is_traceable_wrapper_subclass(x):
        return [x]
    names, _ = x.__tensor_flatten__()
    return [t for name in names for t in inner(getattr(x, name))]


def _dtensor(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _step(path: str, x: torch.Tensor, op: str, fn: Callable[[], Any]):
    try:
        return fn()
    except (NotImplementedError, RuntimeError, AssertionError, TypeError) as e:
        raise NotImplementedError(
            f"shard: {path!r} is a {type(x).__name__}, which fails at {op} ({type(e).__name__}: "
            f"{e}). funcshard shards a tensor subclass as FSDP2 does, with torch.chunk along "
            "the sharded dim, new_zeros of the chunk's shape and copy_ into it; implement "
            f"{op} for {type(x).__name__}, or leave {path!r} out of the sharded tree."
        ) from e


def cut(path: str, x: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """This rank's shard of the subclass tensor ``x``: the block at ``offsets`` of ``sizes``,
    taken by ``torch.chunk`` along each cut dim, as a fresh tensor (``new_zeros`` + ``copy_``).
    See [Note: sharding a tensor subclass].

    Raises:
        NotImplementedError: the subclass lacks an operation the cut needs (naming ``path``
            and the operation), or the block is not one of ``torch.chunk``'s pieces.
    """
    for d, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size == x.shape[d]:
            continue
        x = _chunk(path, x, d, offset, size)
    return fresh(x, path)


def fresh(x: torch.Tensor, path: str = "<tensor>") -> torch.Tensor:
    """A copy of the subclass tensor ``x`` in memory of its own, made with ``new_zeros`` and
    ``copy_`` into a zero-offset ``narrow`` (``clone`` may compute: NF4 quantizes again).

    Raises:
        NotImplementedError: naming ``path`` and the operation the subclass lacks.
    """
    out = _step(path, x, "new_zeros", lambda: x.new_zeros(x.shape))
    target = out
    if out.dim():
        target = _step(path, x, "narrow(start=0)", lambda: out.narrow(0, 0, out.shape[0]))
    _step(path, x, "copy_", lambda: target.copy_(x))
    return out


def _chunk(path: str, x: torch.Tensor, d: int, offset: int, size: int) -> torch.Tensor:
    """The piece of ``x`` at ``offset`` (of ``size``) along ``d``, one of ``torch.chunk``'s."""
    if size == 0:
        return _step(path, x, "new_zeros", lambda: x.new_zeros(*x.shape[:d], 0, *x.shape[d + 1 :]))
    parts = -(-x.shape[d] // size)
    if offset % size:
        raise NotImplementedError(
            f"shard: {path!r} is a {type(x).__name__}, whose shards must be torch.chunk's pieces "
            f"along dim {d}; rows {offset}:{offset + size} of {x.shape[d]} are not one."
        )
    pieces = _step(path, x, f"torch.chunk(dim={d})", lambda: torch.chunk(x, parts, dim=d))
    return pieces[offset // size]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DEVICE_INDEX = re.compile(r"(?<=device\(type=')(\w+)', index=\d+\)|\b(cuda|xpu|hpu|mps):\d+")


def describe(value: Any) -> str:
    """A description of a protocol's metadata that ranks can compare: tensors by dtype and
    shape (their values may differ by rank, as a local amax), other values by ``repr``, without
    what differs between processes for the same value (object addresses, device indices)."""
    leaves, spec = torch.utils._pytree.tree_flatten(value)
    shown = [
        f"tensor({t.dtype}, {list(t.shape)})" if isinstance(t, torch.Tensor) else repr(t)
        for t in leaves
    ]
    text = f"{spec}: {shown}"
    text = _ADDRESS.sub("", text)
    return _DEVICE_INDEX.sub(lambda m: (m.group(1) + "')") if m.group(1) else m.group(2), text)
