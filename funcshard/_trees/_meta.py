"""A module's own tensors left on meta: refused where used, never computed with.

[Note: a tensor left on meta is never computed with]
``module.to("meta")`` is the usual way to drop a module's storage once its parameters live in
a sharded tree; the module then reads every tensor it is not given from meta. Most torch ops
refuse a meta operand beside a real one, but not all: ``x @ w`` and ``F.linear(x, w)`` with a
CPU ``x`` and a meta ``w`` return a CPU tensor computed from uninitialised memory (torch 2.13),
silently -- e.g. a tied head that ``to("meta")`` untied when the ties were never recorded
(``fs.extract`` was not called on that module before the move), or a buffer not passed.

So funcshard's ``functional_call`` hands the module, in place of each own tensor that is on
meta and not given, a :class:`._deferred.Deferred` stand-in whose first use raises an
error naming it -- unless the call is a dry run (every tensor input on meta). A stand-in costs
nothing until used, and a tensor never used (an unused buffer) is no error. Which of the
module's (module, attribute) slots a call leaves to the module depends on the names given
only: it is computed once per module and set of names, and each call then only looks at the
tensors in those slots (usually none).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import nn

from ._deferred import Deferred

Slot = tuple[str, str, str]  # (fqn, owner module's fqn, attribute)
_LEFT: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], tuple[Slot, ...]]]
_LEFT = weakref.WeakKeyDictionary()
_REMEMBERED = 8  # sets of names remembered per module


def guard(module: nn.Module, named: dict[str, Any], args: Any, kwargs: Any) -> dict[str, Any]:
    """``named`` (one name per slot), plus a stand-in that raises when used for each of the
    module's own tensors that ``named`` leaves on meta, unless every tensor input is on meta.

    See [Note: a tensor left on meta is never computed with].
    """
    # .device, not .is_meta: a slot may hold an outer call's Deferred, which answers it as is
    left = [(fqn, t) for fqn, t in _own_tensors(module, named) if t.device.type == "meta"]
    if not left or _dry_run(args, kwargs):
        return named
    raising = _Refuse(module)
    return {**named, **{fqn: Deferred(fqn, t.shape, t.dtype, "meta", raising) for fqn, t in left}}


def _own_tensors(module: nn.Module, named: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors the module would read from itself: its slots that ``named`` does not fill."""
    key = tuple(named)
    known = _LEFT.setdefault(module, {})
    slots = known.get(key)
    if slots is None:
        if len(known) >= _REMEMBERED:
            known.clear()
        known[key] = slots = _unfilled(module, key)
    try:
        owners = [module.get_submodule(prefix) for _, prefix, _ in slots]
    except AttributeError:  # submodules replaced since: look again
        known[key] = slots = _unfilled(module, key)
        owners = [module.get_submodule(prefix) for _, prefix, _ in slots]
    out = []
    for (fqn, _, attr), owner in zip(slots, owners, strict=True):
        t = owner._parameters.get(attr, owner._buffers.get(attr))
        if t is not None:
            out.append((fqn, t))
    return out


def _unfilled(module: nn.Module, names) -> tuple[Slot, ...]:
    filled = {_slot(module, n) for n in names}
    out = []
    for prefix, owner in module.named_modules():
        own = itertools.chain(owner._parameters.items(), owner._buffers.items())
        for attr, t in own:
            if t is not None and (id(owner), attr) not in filled:
                out.append((f"{prefix}.{attr}" if prefix else attr, prefix, attr))
    return tuple(out)


def _slot(module: nn.Module, name: str) -> tuple[int, str]:
    prefix, _, attr = name.rpartition(".")
    try:
        return id(module.get_submodule(prefix)), attr
    except AttributeError:  # not a name of the module: torch reports it
        return -1, name


def _dry_run(args: Any, kwargs: Any) -> bool:
    leaves = optree.tree_leaves((args, kwargs), none_is_leaf=True)
    devices = [x.device.type for x in leaves if isinstance(x, torch.Tensor)]
    return bool(devices) and all(d == "meta" for d in devices)


class _Refuse:
    """The resolver of the stand-ins: raises, naming the tensor."""

    def __init__(self, module: nn.Module) -> None:
        self.name = type(module).__name__

    def resolve(self, fqns) -> list[torch.Tensor]:
        names = ", ".join(map(repr, fqns))
        raise RuntimeError(
            f"functional_call: {self.name} uses {names}, which is on the meta device (no data) "
            "and was not passed; computing with it would read uninitialised memory. Pass it in "
            "the parameter/buffer dicts (fs.extract(module) returns them all). If it is tied to "
            "a parameter you do pass (a tied embedding/head), call fs.extract on this very "
            "module before module.to('meta'): the move unties it, and extract records the tie "
            "(a copy.deepcopy(...).to('meta') made without extract has lost it)."
        )

    def release(self) -> None:
        pass
