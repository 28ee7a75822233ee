"""``extract`` parameters from a module, and ``functional_call`` that keeps tied weights tied.

[Note: remembering ties]
Ties are module structure, but ``module.to("meta")`` -- the usual way to drop a module's own
storage once its parameters live in a sharded tree -- gives each alias its own meta tensor, and
``torch.func.functional_call`` then leaves the alias on meta. ``extract`` therefore records the
module's aliases (``{alias fqn: first fqn}``) in a weak, module-keyed table, and funcshard's
``functional_call`` and ``group`` read it: a fact about the module taken when it was intact, not
state that changes behaviour later.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
import torch.func
from torch import nn

from .._runtime._mode import Mode
from ._activation_checkpoint import reparametrized, watching
from ._meta import guard as guard_meta

_ALIASES: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Walk:
    """One pass over a module tree, shared by the checks of a call.

    [Note: one walk per call]
    A call checks the module several ways (FSDP wrapping, ties, shapes, BatchNorm statistics)
    and names one slot per (module, attribute). Each used to walk the module tree on its own
    (``named_parameters``, ``named_buffers``, ``named_modules``, ``get_submodule`` per name): a
    cost per module and per call that a host-bound step pays on every block. One walk collects
    what all of them read; the module is walked again at each call, so a changed module is
    seen.
    """

    modules: tuple[tuple[str, nn.Module], ...]  # every (prefix, module), shared ones repeated
    tensors: tuple[tuple[str, torch.Tensor, bool], ...]  # (name, tensor, is a parameter)
    slots: dict[str, tuple[int, str]]  # name -> (id of its owner module, attribute)

    @staticmethod
    def of(module: nn.Module) -> Walk:
        modules = tuple(module.named_modules(remove_duplicate=False))
        tensors, slots = [], {}
        for prefix, m in modules:
            dot = f"{prefix}." if prefix else ""
            for attr, t in m._parameters.items():
                if t is not None:
                    tensors.append((dot + attr, t, True))
                    slots[dot + attr] = (id(m), attr)
            for attr, t in m._buffers.items():
                if t is not None:
                    tensors.append((dot + attr, t, False))
                    slots[dot + attr] = (id(m), attr)
        return Walk(modules, tuple(tensors), slots)

    def aliases(self) -> dict[str, str]:
        first: dict[int, str] = {}
        out = {}
        for name, t, _ in self.tensors:
            canonical = first.setdefault(id(t), name)
            if canonical != name:
                out[name] = canonical
        return out


def extract(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's parameters and buffers as flat dicts ``fqn -> tensor`` (no copies).

    In ``named_parameters()`` / ``named_buffers()`` order. A tied tensor appears once, under its
    first name; the other names are remembered so that :func:`functional_call` (and
    :func:`~funcshard.group`) keep it tied, even after ``module.to("meta")``.
    """
    _ALIASES[module] = recorded = _recorded_aliases(module)
    params = {k: v for k, v in module.named_parameters() if k not in recorded}
    return params, {k: v for k, v in module.named_buffers() if k not in recorded}


def check_not_wrapped(module: nn.Module, fn: str, walk: Walk | None = None) -> None:
    """Raises ``ValueError`` if ``module`` or a submodule is already sharded by FSDP."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for fqn, m in module.named_modules() if walk is None else walk.modules:
        if isinstance(m, FSDPModule | FullyShardedDataParallel):
            raise ValueError(
                f"{fn}: module {fqn or '<root>'!r} ({type(m).__name__}) is already sharded by "
                "FSDP / fully_shard, whose parameters funcshard cannot use. funcshard shards a "
                "plain module itself: build the model again without fully_shard (double wrapping "
                "is not supported); to bring an FSDP2 model's weights over, save its state dict "
                "with torch.distributed.checkpoint and load it into funcshard's shards."
            )


def _recorded_aliases(module: nn.Module) -> dict[str, str]:
    """Live ties, plus earlier recorded ones that only ``to("meta")`` broke (both on meta)."""
    live = _live_aliases(module)
    tensors = dict(_named_tensors(module))
    kept = {
        a: c
        for a, c in _ALIASES.get(module, {}).items()
        if a in tensors and c in tensors and tensors[a].is_meta and tensors[c].is_meta
    }
    return {**kept, **live}


def _live_aliases(module: nn.Module) -> dict[str, str]:
    return Walk.of(module).aliases()


def aliases(module: nn.Module, walk: Walk | None = None) -> dict[str, str]:
    """``{alias: first name}`` for tied tensors, as recorded by :func:`extract` (or live)."""
    live = (walk or Walk.of(module)).aliases()
    return {**live, **_ALIASES.get(module, {})}


def _fill_ties(alias: dict[str, str], given: Mapping[str, Any]) -> dict[str, Any]:
    """Values for the names of each tie set that were not given, from the one that was.

    Raises:
        ValueError: different values given for names of one tie set.
    """
    sets: dict[str, set[str]] = {}
    for a, c in alias.items():
        sets.setdefault(c, {c}).add(a)
    fill = {}
    for names in sets.values():
        values = {id(given[n]): given[n] for n in names if n in given}
        if len(values) > 1:
            raise ValueError(
                f"functional_call got different tensors for {sorted(names)}, which are one tied "
                "tensor of the module. Give it under one name only (the dicts of fs.extract do; "
                "the other names follow): a dict built from named_parameters() or state_dict() "
                "after module.to('meta') has an untied copy under each name. To untie them on "
                "purpose, pass tie_weights=False."
            )
        if values:
            (value,) = values.values()
            fill.update({n: value for n in names if n not in given})
    return fill


def functional_call(
    module: nn.Module,
    parameter_and_buffer_dicts: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """``torch.func.functional_call``, plus the ties recorded by :func:`extract`.

    Same signature and semantics. With ``tie_weights=True``, every alias recorded when the module
    was extracted gets the value given for its first name (unless given itself), so a tied
    embedding/head stays tied even if the module was moved to meta afterwards.

    [Note: shared modules]
    A module reachable under two names (``self.a = self.b = block``) holds one slot for both.
    ``torch.func.functional_call`` swaps in a value per *name* and restores in the same order, so
    the second swap saves the first's replacement as "original" and the module keeps the
    replacement after the call (torch 2.13). The ties are therefore resolved here, and torch gets
    one name per (module, attribute) slot, with its own tie handling off.

    Raises:
        ValueError: different values for tied names; a name given in two dicts; a tensor whose
            shape differs from the module's own (on meta too); float64 parameters mixed with
            lower-precision ones. See [Note: what functional_call checks].
        RuntimeError: ``strict=True`` and names are missing or unexpected (torch's message);
            the module uses one of its own tensors that is on meta and not given, while the
            inputs are not on meta (see [Note: a tensor left on meta is never computed with]).
    """
    walk = Walk.of(module)
    check_not_wrapped(module, "functional_call", walk)
    named = slots(module, parameter_and_buffer_dicts, tie_weights, strict, walk)
    # see [Note: activation checkpointing inside a funcshard call]
    rebind = (lambda: reparametrized(module, named)) if eager_grad() else None
    return call(module, named, args, kwargs, rebind)


def slots(
    module, parameter_and_buffer_dicts, tie_weights: bool, strict: bool, walk: Walk | None = None
) -> dict[str, Any]:
    """The dicts merged, ties filled, one name per (module, attribute) slot: what
    ``torch.func.functional_call`` gets (see [Note: shared modules]). ``walk``: the module's,
    if the caller made it (see [Note: one walk per call])."""
    walk = walk or Walk.of(module)
    dicts = (
        [parameter_and_buffer_dicts]
        if isinstance(parameter_and_buffer_dicts, Mapping)
        else list(parameter_and_buffer_dicts)
    )
    given = {k: v for d in dicts for k, v in d.items()}
    if len(given) < sum(len(d) for d in dicts):  # torch's message
        seen = [k for d in dicts for k in d]
        dups = sorted({k for k in seen if seen.count(k) > 1})
        raise ValueError(
            f"{dups} appeared in multiple dictionaries; behavior of functional call is ambiguous"
        )
    if tie_weights:
        given.update(_fill_ties(aliases(module, walk), given))
    if strict:
        _check_strict(module, given, walk)
    _check_given(module, given, walk)
    return _one_per_slot(module, given, walk)


def call(module: nn.Module, named: dict[str, Any], args, kwargs, rebind=None) -> Any:
    """``module`` called with the ``named`` slots swapped in; with ``rebind``, each checkpoint
    region that uses a tensor requiring grad recomputes inside ``rebind()`` (see [Note:
    activation checkpointing inside a funcshard call]). A tensor the module would read from
    itself on meta is refused where used (see ``_meta``)."""
    named = guard_meta(module, named, args, kwargs)
    args = () if args is None else args
    try:
        slots = named if rebind is None else watching(named, rebind)
        return torch.func.functional_call(module, slots, args, kwargs, tie_weights=False)
    except RuntimeError as e:  # name a dtype mismatch of the inputs, if that is what it was
        floating = {v.dtype for v in named.values() if isinstance(v, torch.Tensor)}
        hint = input_dtype_hint(args, kwargs, {d for d in floating if d.is_floating_point})
        if hint:
            raise RuntimeError(f"functional_call: the forward failed ({e}).{hint}") from e
        raise


def eager_grad() -> bool:
    """Grad mode in plain eager autograd: where ``torch.utils.checkpoint`` may run (not inside
    ``torch.func`` transforms, which refuse it, nor while ``torch.compile`` traces)."""
    return torch.is_grad_enabled() and Mode.now().plain


def _check_strict(module: nn.Module, given: Mapping[str, Any], walk: Walk) -> None:
    """``strict=True``: every name of the module (shared and tied ones included), no other."""
    names = {n for n, _, _ in walk.tensors}
    missing, unexpected = sorted(names - set(given)), sorted(set(given) - names)
    errors = [f"Unexpected key(s): {', '.join(map(repr, unexpected))}."] if unexpected else []
    errors += [f"Missing key(s): {', '.join(map(repr, missing))}."] if missing else []
    if errors:
        raise RuntimeError(
            f"Error(s) in reparametrizing for {module._get_name()}:\n\t" + "\n\t".join(errors)
        )


def _named_tensors(module: nn.Module):
    return itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )


def _one_per_slot(
    module: nn.Module, named: Mapping[str, Any], walk: Walk | None = None
) -> dict[str, Any]:
    """``named`` without the names that reach an already-named (module, attribute) slot."""
    slots = (walk or Walk.of(module)).slots
    seen, out = set(), {}
    for name, value in named.items():
        slot = slots.get(name)
        if slot is None:  # not a tensor slot of the module (yet): by its owner module
            prefix, _, attr = name.rpartition(".")
            try:
                slot = (id(module.get_submodule(prefix)), attr)
            except AttributeError:  # unknown: torch reports it
                slot = (name, attr)
        if slot not in seen:
            seen.add(slot)
            out[name] = value
    return out


def _check_given(module: nn.Module, given: Mapping[str, Any], walk: Walk) -> None:
    """[Note: what functional_call checks]
    The module (on meta too) knows every parameter's and buffer's global shape, so a value of
    another shape -- a tree extracted from another configuration, a shard passed where the
    full tensor belongs -- is named here, before the forward fails inside some matmul
    (``mat1 and mat2 shapes cannot be multiplied``). Three more mistakes would only fail deep
    inside the forward, or not at all: float64 parameters mixed with float32/bf16 ones (a model
    partly converted with ``.double()``); BatchNorm running statistics in bf16/fp16 while
    training (each update
    ``(1 - momentum) * mean + momentum * batch_mean`` rounds away). Cost: one pass over the
    module's named tensors and modules per call (no communication); under ``torch.compile``,
    at trace time only.
    """
    dtypes: dict[torch.dtype, str] = {}
    for name, own, is_param in walk.tensors:  # tensors left on meta: see _meta (where used)
        value = given.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        shape, dtype = metadata(value)
        if shape != own.shape:
            owner = type(module.get_submodule(name.rpartition(".")[0])).__name__
            raise ValueError(
                f"functional_call: {name!r} has shape {list(shape)}, but the module's "
                f"{'parameter' if is_param else 'buffer'} {name!r} ({owner}) has "
                f"{list(own.shape)}. Pass the full tensors of this configuration (fs.unshard "
                "the shards of fs.extract(module) for this very module)."
            )
        if is_param and dtype.is_floating_point:
            dtypes.setdefault(dtype, name)
    if torch.float64 in dtypes and len(dtypes) > 1:
        wide = dtypes.pop(torch.float64)
        other, narrow = next(iter(dtypes.items()))
        raise ValueError(
            f"functional_call: parameters of different precision: {wide!r} is float64, "
            f"{narrow!r} is {str(other).removeprefix('torch.')}. Convert the model to one dtype "
            "before extracting it (model.to(torch.float32)), or compute in one dtype with "
            "param_dtype=."
        )
    _check_batchnorm(given, walk)


def metadata(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """``(t.shape, t.dtype)``, without a subclass's ``__torch_function__`` (a ``Deferred``
    answers these itself, at a dispatch per query)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.shape, t.dtype


def _check_batchnorm(given: Mapping[str, Any], walk: Walk) -> None:
    for prefix, m in walk.modules:
        if not (isinstance(m, nn.modules.batchnorm._NormBase) and m.training):
            continue
        stats = given.get(f"{prefix}.running_mean" if prefix else "running_mean")
        if isinstance(stats, torch.Tensor) and stats.dtype in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"functional_call: {prefix!r} ({type(m).__name__}) is training with its running "
                f"statistics in {str(stats.dtype).removeprefix('torch.')}: each update rounds "
                "away. Keep the buffers in float32 (cast only the parameters: param_dtype=), "
                "or call module.eval() if the statistics are not updated."
            )


def input_dtype_hint(args: Any, kwargs: Any, dtypes: set) -> str:
    """A hint for a forward that failed: a floating-point input of another dtype than the
    (single) compute dtype of the parameters, e.g. fp32 inputs with ``param_dtype=bf16``."""
    if len(dtypes) != 1:
        return ""
    (dtype,) = dtypes
    leaves = optree.tree_leaves((args, kwargs), none_is_leaf=False)
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return (
                f" The parameters are {str(dtype).removeprefix('torch.')} but input {i} (in "
                f"the order of (args, kwargs)) is {str(x.dtype).removeprefix('torch.')}: cast "
                f"the inputs (x.to({dtype})), as FSDP2's MixedPrecisionPolicy("
                "cast_forward_inputs=True) does."
            )
    return ""
