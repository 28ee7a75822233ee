"""Optimizer state and master weights in CPU memory, the update on CPU (FSDP2's
``CPUOffloadPolicy``): only the compute copy of the parameters stays on the device.

[Note: offloaded optimizer state]
``offload(inner)`` keeps, per parameter, a float32 *master* copy of this rank's shard in CPU
memory (pinned when the parameters are on CUDA, so that copies run asynchronously) and ``inner``'s
state beside it, built from the masters. A step copies the gradients' shards to the CPU, runs
``inner`` there on the masters (torch's CPU kernels), and copies the masters back into the
parameters, cast to their dtype: device memory holds the parameters and gradients only. The
masters and the state are DTensors placed like the parameters whose local tensors live in CPU
memory (as FSDP2's offloaded parameters are), so ``fs.checkpoint`` saves and reshards them.
``inner`` runs on CPU tensors, so it must not communicate on a backend without CPU support
(NCCL): clip the gradients before (``chain(clip_by_global_norm(c), offload(adamw(lr)))``), and
keep Muon, whose all-to-alls move its blocks, on the device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .._trees._dtensor import _as_dtensor
from .._trees._spec import ShardSpec
from .._trees._tree import PyTree, flatten, unflatten
from ._base import GradientTransformation, apply_updates, leaves_like, local, wrap


class OffloadState(NamedTuple):
    """State of :func:`offload`: ``master`` (float32 copies of the parameters' shards in CPU
    memory, placed like the parameters) and ``inner``, the wrapped optimizer's state (in CPU
    memory too)."""

    master: PyTree
    inner: Any


def offload(
    inner: GradientTransformation, *, master_dtype: torch.dtype = torch.float32
) -> GradientTransformation:
    """``inner`` run in CPU memory on float32 master weights (see [Note: offloaded optimizer
    state]).

    With :func:`step` (donated) the parameters receive the new masters, cast to their own dtype
    (a bfloat16 compute copy of float32 masters, say). The pure ``update`` returns ``new - old``
    on the device, in the parameters' dtype.

    Args:
        inner: an optimizer whose update needs no communication (``adamw``, ``sgd``, masks and
            partitions of them); clip before it.
        master_dtype: the masters' dtype.
    """

    def init(params):
        master = _to_host(params, master_dtype)
        return OffloadState(master, inner.init(master))

    def run(grads, state, params, inplace: bool):
        if not isinstance(state, OffloadState):
            raise TypeError(
                f"offload: the state is a {type(state).__name__}, not the OffloadState that "
                "this transformation's init returned."
            )
        host_grads = _to_host(grads, master_dtype)
        if inplace:
            update = inner.update_inplace or inner.update
            updates, inner_state = update(host_grads, state.inner, state.master)
            master = apply_updates(state.master, updates, inplace=True)
        else:
            updates, inner_state = inner.update(host_grads, state.inner, state.master)
            master = apply_updates(state.master, updates)
        return _back(grads, params, master, inplace), OffloadState(master, inner_state)

    return GradientTransformation(
        init,
        lambda grads, state, params=None: run(grads, state, params, False),
        lambda grads, state, params=None: run(grads, state, params, True),
    )


def _to_host(tree: PyTree, dtype: torch.dtype) -> PyTree:
    """Each floating-point leaf's shard copied to CPU memory as ``dtype`` (pinned when it comes
    from CUDA, waited for), placed like the leaf."""
    _, xs, spec = flatten(tree, none_is_leaf=True)
    out = []
    for x in xs:
        if x is None or not x.is_floating_point():
            out.append(None)
            continue
        t = local(x)
        host = torch.empty(t.shape, dtype=dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        out.append(_as_dtensor(host, ShardSpec.of(x)) if isinstance(x, DTensor) else host)
    if any(local(x).is_cuda for x in xs if x is not None):
        torch.cuda.current_stream().synchronize()  # the copies into pinned memory
    return unflatten(spec, out)


def _back(grads, params, master, inplace: bool) -> PyTree:
    """The masters into the parameters (donated; ``None`` updates) or ``new - old`` (pure)."""
    _, ps, spec = flatten(params, none_is_leaf=True)
    gs = leaves_like(grads, params, "grads", "params")
    ms = leaves_like(master, params, "offload state.master", "params")
    out: list[Any] = [None] * len(ps)
    for i, (p, g, m) in enumerate(zip(ps, gs, ms, strict=True)):
        if g is None or m is None:
            continue
        target = local(p)
        if inplace:
            target.copy_(local(m), non_blocking=target.is_cuda)
        else:
            new = local(m).to(target.device, target.dtype, non_blocking=target.is_cuda, copy=True)
            out[i] = wrap(new.sub_(target), p)
    return unflatten(spec, out)
