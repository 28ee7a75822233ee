"""Debug mode: the ranks compare the full tensors they give ``fs.shard``.

[Note: the same initial values]
``shard`` keeps this rank's chunk of each full tensor, trusting that every rank holds the same
values: a model initialised with another seed on one rank trains a mix of two models, silently.
In debug mode (``FUNCSHARD_DEBUG=1`` or ``fs.checking_collectives()``, see ``_debug``) every rank
hashes each full tensor's bytes and the ranks compare the hashes through the per-call check
(see [Note: one status per call] in ``_consensus``): one exchange per ``shard`` call and a pass
over the model's bytes (blake2b, 0.3 GiB/s of one CPU core's time measured on a loaded 2-core
host; a copy to the host for a GPU tensor). A difference is a ``ValueError`` on
every rank naming the first tensor that differs; an error raised by one rank's ``shard`` is
raised on every rank. Tensors on meta (to be materialised) and DTensors (already parallel) are
not compared.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from .._trees._tree import flatten
from . import _consensus, _debug

F = TypeVar("F", bound=Callable[..., Any])
_FN = "shard (FUNCSHARD_DEBUG: the full tensors' values)"


def checked(shard: F) -> F:
    """``shard``, which in debug mode also checks that every rank passed the same values (see
    [Note: the same initial values])."""

    @functools.wraps(shard)
    def run(params, *args, **kwargs):
        if not _debug.enabled():
            return shard(params, *args, **kwargs)
        with _consensus.failing(_FN):
            out = shard(params, *args, **kwargs)
            _consensus.agree(_FN, (), hashes(params))
        return out

    return run  # type: ignore[return-value]


def hashes(params: Any) -> tuple[tuple[str, str], ...]:
    """``(f"values of {path}", "hash <hex>, sum <sum>")`` per full tensor of ``params``."""
    paths, leaves, _ = flatten(params)
    out = []
    for path, x in zip(paths, leaves, strict=True):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.device.type != "meta":
            data = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            digest = hashlib.blake2b(data, digest_size=8).hexdigest()
            out.append((f"values of {path}", f"hash {digest}, sum {float(x.detach().sum()):.6g}"))
    return tuple(out)
