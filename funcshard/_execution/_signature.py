"""A call's signature: what a compiled or captured step is keyed by (``fs.jit``,
``fs.cuda_graph``), and the words for what changed between two calls.

A call's key is the structure of its arguments, each tensor's type, global and local shape,
local strides, dtype, device and placements (with the mesh), and every other leaf's value (an
unhashable one by its identity). Two calls with equal keys run the same program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from .._trees._dtensor import _local as _dtensor_local


def local(x: Tensor) -> Tensor:
    """A DTensor's local tensor (no ``to_local()``: an aten call per leaf per call would be most
    of a replayed step's host time), or ``x``."""
    return _dtensor_local(x) if isinstance(x, DTensor) else x


def leaf_key(x: Any) -> Any:
    """One leaf's part of the key."""
    if isinstance(x, Tensor):
        loc = local(x)
        placed = (x.placements, x.device_mesh) if isinstance(x, DTensor) else None
        return (type(x), tuple(x.shape), x.dtype, loc.device, tuple(loc.shape), loc.stride(),
                placed)  # fmt: skip
    try:
        hash(x)
    except TypeError:
        return ("object", id(x))
    return (type(x), x)


class Keys:
    """Leaf keys with a memory of the last call: a leaf that is the last call's object at the
    same place keeps its key (the donated trees come back as they were returned: only the
    batch is new), so a step's key costs little more than its flattening."""

    def __init__(self) -> None:
        self.leaves: list = []
        self.keys: list = []

    def __call__(self, leaves: list) -> tuple:
        old, old_keys = self.leaves, self.keys
        same = len(old) == len(leaves)
        keys = tuple(
            old_keys[i] if same and x is old[i] else leaf_key(x) for i, x in enumerate(leaves)
        )
        self.leaves, self.keys = leaves, list(keys)
        return keys


def describe_key(k: Any) -> str:
    """A leaf key in words: ``a DTensor [8, 4] torch.float32 on cpu Shard(dim=0)``."""
    if isinstance(k, tuple) and len(k) == 7 and isinstance(k[0], type):
        kind, shape, dtype, device, _, _, placed = k
        where = f" {placed[0]}" if placed else ""
        return f"a {kind.__name__} {list(shape)} {dtype} on {device}{where}"
    if isinstance(k, tuple) and k and k[0] == "object":
        return "an unhashable object (compared by identity)"
    return f"{k[1]!r}" if isinstance(k, tuple) and len(k) == 2 else repr(k)


def difference(old: tuple | None, paths: Sequence[str], key: tuple) -> str:
    """What differs between ``old`` and ``key``, two ``(structure, leaf keys)`` keys; ``paths``:
    the key paths of ``key``'s leaves."""
    if old is None:
        return "the first call"
    if old[0] != key[0]:
        return "the arguments' tree structure differs from the last call's"
    for path, a, b in zip(paths, old[1], key[1], strict=True):
        if a != b:
            return f"{path!r} is {describe_key(b)}, was {describe_key(a)}"
    return "the arguments differ from every earlier call's"
