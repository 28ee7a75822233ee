"""``torch.utils.checkpoint`` inside a funcshard call: the recompute sees the call's parameters.

[Note: activation checkpointing inside a funcshard call]
Non-reentrant ``torch.utils.checkpoint`` (what Hugging Face's ``gradient_checkpointing_enable()``
and torchtitan's checkpoint wrapper use) runs a region's forward without keeping its activations
and, in backward, runs the *same function* again: ``layer.__call__`` reads ``self.weight`` from
the module at that time. funcshard calls a module with parameters swapped in for the duration
of the call only (``functional_call``), so by backward the module holds its own tensors again:
meta tensors (the documented pattern) or stale ones (silently wrong gradients once the shards
have moved on).

So each checkpoint region that runs inside a funcshard call is *bound* to that call: its frame's
recompute function is wrapped to run with the call's parameters swapped in again (``rebind``).
Only values matter there: the recompute provides saved tensors to the nodes recorded in forward,
whose edges already lead to the call's parameters, so gradients flow where they did in forward.
Under :func:`~funcshard.schedule` the parameters swapped in are the call's ``Deferred``
placeholders, so the recompute re-gathers its group through the plan's backward steps: the same
single all-gather per group in backward that saved tensors would trigger.

A region is found when it runs: the innermost saved-tensor hooks during a checkpointed forward are
the region's own, and their closure holds its frame. ``schedule`` looks when a parameter is
resolved (every region that uses a parameter resolves one inside it); ``functional_call`` with
plain tensors does the same by passing the tensors that require grad as ``Deferred`` stand-ins
that resolve to them (``watching``; eager grad mode only, nothing is registered on the module).
This file is the only place that relies on how ``torch.utils.checkpoint`` stores its frames
(``tests/test_activation_checkpoint.py``).

``use_reentrant=True`` checkpoints run their forward under ``no_grad`` and differentiate the
recompute separately; they are refused (``check_not_reentrant``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import checkpoint as _ckpt

from ._deferred import Deferred

_Rebind = Callable[[], contextlib.AbstractContextManager]


def current_frame(skip_owner: object = None) -> Any:
    """The frame of the innermost non-reentrant checkpoint region running its forward, or
    ``None``. ``skip_owner``: saved-tensor hooks bound to this object are not a region."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    if skip_owner is not None and getattr(pack, "__self__", None) is skip_owner:
        return None
    for cell in getattr(pack, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _ckpt._CheckpointFrame):
            return value
    return None


def bind(frame: Any, rebind: _Rebind) -> None:
    """Make ``frame``'s recompute run inside ``rebind()`` (once per frame: the first binding,
    made by the innermost funcshard call that sees the region, wins)."""
    original = frame.recompute_fn
    if getattr(original, "_funcshard_bound", False):
        return

    def recompute(*args: Any) -> None:
        with rebind():
            original(*args)

    recompute._funcshard_bound = True  # type: ignore[attr-defined]
    frame.recompute_fn = recompute


def name_failures(frame: Any, error: Callable[[BaseException], BaseException]) -> None:
    """Make ``frame``'s recompute raise ``error(e) from e`` for any error ``e`` it raises, and
    for torch's own check that it saved the tensors the forward saved (``CheckpointError``).
    Once per frame; torch's early stop (an internal exception) and running out of memory pass
    through."""
    if getattr(frame, "_funcshard_named", False):
        return
    frame._funcshard_named = True
    # [Note: nothing on a frame refers to the frame]
    # The frame keeps its region's inputs (for the recompute) until it dies, which should be as
    # soon as the region's backward ends. A closure stored on the frame that holds the frame --
    # its bound method ``check_recomputed_tensors_match`` -- makes a cycle: the inputs of every
    # recomputed region would then stay alive until Python's cycle collector runs, at a point
    # no one can predict (measured: all six blocks' inputs still alive at the last block's
    # backward). So the check is taken from the class and given the frame through a weak
    # reference.
    recompute, check = frame.recompute_fn, type(frame).check_recomputed_tensors_match
    frame_ref = weakref.ref(frame)

    def named(e: BaseException) -> BaseException:
        out = error(e)
        out._funcshard_named = True  # type: ignore[attr-defined]  # an enclosing region's too
        return out

    def recompute_named(*args: Any) -> None:
        try:
            recompute(*args)
        except (_ckpt._StopRecomputationError, torch.OutOfMemoryError):  # not a difference
            raise
        except Exception as e:
            if getattr(e, "_funcshard_named", False):  # named by a region inside this one
                raise
            raise named(e) from e

    def check_named(gid: Any) -> None:
        try:
            check(frame_ref(), gid)
        except _ckpt.CheckpointError as e:
            raise named(e) from e

    bound = getattr(recompute, "_funcshard_bound", False)  # see bind
    recompute_named._funcshard_bound = bound  # type: ignore[attr-defined]
    frame.recompute_fn = recompute_named
    frame.check_recomputed_tensors_match = check_named


def reparametrized(module: nn.Module, slots: dict[str, Any]) -> contextlib.AbstractContextManager:
    """``module`` with ``slots`` swapped in (one name per slot, see ``_extract._one_per_slot``)
    until the context exits: what ``torch.func.functional_call`` does around its call."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, slots, tie_weights=False, strict=False)


def watching(named: dict[str, Any], rebind: _Rebind) -> dict[str, Any]:
    """``named`` with each tensor that requires grad replaced by a ``Deferred`` stand-in that
    resolves to it, binding the checkpoint region it is resolved in to ``rebind``."""
    watch = _Watch(named, rebind)
    return {
        k: Deferred(k, v.shape, v.dtype, v.device, watch, isinstance(v, DTensor))
        if isinstance(v, torch.Tensor) and not isinstance(v, Deferred) and v.requires_grad
        else v
        for k, v in named.items()
    }


class _Watch:
    """The resolver of :func:`watching`'s stand-ins."""

    sealed = None  # no recompute group here (see ``_deferred.Resolver``)

    def __init__(self, named: dict[str, Any], rebind: _Rebind) -> None:
        self.named, self.rebind = named, rebind

    def resolve(self, fqns) -> list[torch.Tensor]:
        frame = current_frame()
        if frame is not None:
            bind(frame, self.rebind)
        else:
            check_not_reentrant()
        return [self.named[f] for f in fqns]

    def release(self) -> None:
        pass


def check_not_reentrant() -> None:
    """Raises ``RuntimeError`` in the forward of a ``use_reentrant=True`` checkpoint (which turns
    grad mode off: looked for on the Python stack only then)."""
    if torch.is_grad_enabled():
        return
    forward = _ckpt.CheckpointFunction.forward.__code__
    f = sys._getframe(1)
    while f is not None and f.f_code is not forward:
        f = f.f_back
    if f is not None:
        raise RuntimeError(
            "activation checkpointing with use_reentrant=True is not supported inside a funcshard "
            "call (its recompute is differentiated apart from the graph, so the shards would get "
            "no gradient). Use torch.utils.checkpoint(..., use_reentrant=False); for Hugging Face "
            "models model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
            "{'use_reentrant': False}); or the plan's own recompute (docs/schedule.md)."
        )
