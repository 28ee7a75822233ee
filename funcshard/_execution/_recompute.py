"""Recompute in backward: the plan's activation checkpointing (``Group.recompute``).

[Note: recompute as part of the plan]
A recompute group's module (``module.get_submodule(group.name)``) runs in forward inside one
autograd Function, :class:`_Recompute`, whose inputs are the module's tensor arguments and the
tensors bound to its parameters and buffers -- the group's gathered full tensors, explicit
inputs so that their gradients flow to the gather's backward (the reduce-scatter). The Function
keeps its inputs and nothing of the forward's intermediates; its backward runs the module's
forward again on the same tensors and takes the vector-Jacobian product. Nothing of
``torch.utils.checkpoint`` or saved-tensor hooks is used inside, so it works at every level of
``torch.func`` transforms (``grad``, ``vmap(grad)``, ``grad(grad)``), where those are refused
(pytorch #122729): there the vector-Jacobian product is ``torch.func.vjp``; under plain autograd
it is ``torch.autograd.grad``, with the module's parameters bound during the whole backward (a
``torch.utils.checkpoint`` inside the module then recomputes with them too).

[Note: plain autograd stops early]
Under plain autograd (no ``torch.func`` transform, not compiling) a recompute group whose module
holds no BatchNorm runs through ``torch.utils.checkpoint(use_reentrant=False)`` instead: its
recompute stops once the last tensor backward needs is rebuilt (skipping, e.g., a block's last
matmul), and a funcshard call binds each checkpoint region to its parameters (see [Note:
activation checkpointing inside a funcshard call]), so the recompute re-gathers the group through
the plan's backward steps just the same. BatchNorm keeps the Function (its running statistics are
updated once, where ``torch.utils.checkpoint`` would update them again).

With reshard after forward, the group's full tensors are among the Function's saved tensors, so
the scheduler's saved-tensor hooks free them after forward and re-gather them when the backward
unpacks them: the recompute uses the backward's one re-gather, as FSDP2 with activation
checkpointing does. The module is called through its ``forward`` attribute, replaced on the
instance for the duration of the scheduled call (no hooks are registered), and runs with its
parameters and buffers bound to the Function's inputs (the module may be on meta). Random ops
draw the same numbers in the recompute (the RNG states are saved and restored, as
``torch.utils.checkpoint(preserve_rng_state=True)``), and autocast is re-entered as it was.
Buffers the module updates in place (BatchNorm's running statistics) are updated once: the
recompute works on copies of them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optree
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils.stateless import _reparametrize_module  # private: see test_recompute.py
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import (
    DefaultDeviceType,
    checkpoint,
    get_device_states,
    set_device_states,
)

from .._plans._plan import Plan
from .._runtime._mode import transformed
from .._trees._activation_checkpoint import current_frame, name_failures
from .._trees._deferred import Deferred, release_all, resolve_all
from .._trees._extract import _one_per_slot, aliases, eager_grad

_AUTOCAST_DEVICES = ("cpu", "cuda")


def modules(module: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    """``{group name: its module}`` for the plan's recompute groups.

    Raises:
        ValueError: a recompute group names no submodule of ``module`` (a merged group), or its
            module holds parameters of another group.
    """
    out = {}
    group_of, tied = plan.group_of(), aliases(module)
    for g in plan.groups:
        if not g.recompute:
            continue
        try:
            out[g.name] = sub = module.get_submodule(g.name)
        except AttributeError:
            raise ValueError(
                f"schedule: group {g.name!r} recomputes in backward, but the module has no "
                "submodule of that name (a group merged by fs.merge_groups is not a module): "
                "recompute groups that are modules, e.g. plan.with_recompute([...])."
            ) from None
        fqns = (f"{g.name}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False))
        others = {group_of.get(tied.get(f, f), g.name) for f in fqns} - {g.name}
        if others:
            raise ValueError(
                f"schedule: group {g.name!r} recomputes in backward, but its module holds "
                f"parameters of the groups {sorted(others)}; recompute those groups instead, or "
                "make the module one group (a policy that does not split it)."
            )
    return out


@contextlib.contextmanager
def recomputing(subs: Mapping[str, nn.Module], wrap: Callable | None = None) -> Iterator[None]:
    """While the scheduled call runs, each module of ``subs`` runs through :class:`_Recompute`
    (its ``forward`` attribute replaced on the instance by ``wrap(sub, forward, name)``, by
    default :func:`_recomputed`, then restored)."""
    wrap = wrap or _recomputed
    saved = []
    try:
        for name, sub in subs.items():
            own = sub.__dict__.get("forward")  # an instance attribute of its own, if any
            saved.append((sub, own))
            sub.forward = wrap(sub, own or sub.forward, name)
        yield
    finally:
        for sub, own in reversed(saved):
            if own is None:
                sub.__dict__.pop("forward", None)
            else:
                sub.forward = own


def refuse(group: str, fqns) -> None:
    """Raises: a recompute group's forward used parameters it does not own (see ``_Run``)."""
    raise ValueError(
        f"schedule: the module of group {group!r}, which recomputes in backward, used the "
        f"parameters {list(fqns)} of another group in its forward; their gradients would be "
        "lost. A recompute group's module must compute with its own parameters and its inputs: "
        "pass the tensor as an argument, or do not recompute this group."
    )


def _recomputed(sub: nn.Module, forward: Callable, group: str) -> Callable:
    """``sub``'s forward through :class:`_Recompute` (plain while gradients are off)."""

    checkpointable = not any(isinstance(m, _BatchNorm) for m in sub.modules())

    def named(*args: Any, **kwargs: Any) -> Any:  # the checkpointed function
        frame = current_frame()
        if frame is not None:  # in forward: its recompute's failures name the group
            name_failures(frame, lambda e: differed(group, e))
        return forward(*args, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to keep or recompute
            return forward(*args, **kwargs)
        args, kwargs = without_cache(sub, args, kwargs)
        if checkpointable and eager_grad():  # see [Note: plain autograd stops early]
            resolvers = {id(r): r for r in _resolvers(sub)}.values()
            for resolver in resolvers:  # a parameter of another group is refused meanwhile
                resolver.sealed = group
            try:
                return checkpoint(named, *args, use_reentrant=False, **kwargs)
            finally:
                for resolver in resolvers:
                    resolver.sealed = None
        call, real, resolvers = prepared(sub, forward, args, kwargs)
        call.group = group  # checked: see [Note: a recompute that differs from its forward]
        try:
            for resolver in resolvers:  # a parameter of another group is refused meanwhile
                resolver.sealed = group
            out = _Recompute.apply(call, *real)
        finally:
            for resolver in resolvers:
                resolver.sealed = None
            release_all(resolvers)
        return call.outputs(out)

    return run


# [Note: a recompute that differs from its forward]
# A recompute must compute what its forward computed. A module that writes state during its
# forward and reads it back breaks that: a key/value cache (Hugging Face's ``use_cache=True``)
# gets the keys appended a second time, and the recompute's attention reads the forward's keys,
# which lead to no gradient: the loss is right and the gradients silently wrong. So:
#
# * Hugging Face layers (``GradientCheckpointingLayer``) run without a cache in a recomputed
#   group, as their own gradient checkpointing runs them, with a warning (``without_cache``);
# * under plain autograd, ``torch.utils.checkpoint`` compares the number, shapes and dtypes of
#   the tensors the recompute saves with the forward's; its error, and any error of the recompute,
#   is raised again naming the group and the likely cause (``name_failures``);
# * in the Function (``torch.func``, ``torch.compile``, BatchNorm), the forward notes the tensors
#   it computes from its inputs (``_Provenance``); the recompute may read none of those still alive
#   (kept as state), and must return the same structure, shapes and dtypes.
#
# The last check costs a Python call per torch function in the forward and the recompute of a
# group that runs through the Function, as ``torch.utils.checkpoint``'s hooks cost one per saved
# tensor; under ``torch.compile`` it runs while tracing only.

_CAUSE = (
    "The module most likely writes state during its forward and reads it again (a key/value "
    "cache: Hugging Face's use_cache=True, or a tensor kept on the module), so recomputing it "
    "would give wrong gradients. Run it without that state (use_cache=False), keep its forward "
    "free of writes to the module, or do not recompute this group (plan.with_recompute)."
)


def differed(group: str, error: BaseException) -> RuntimeError:
    """The error for a recompute of ``group`` that failed or differed from its forward."""
    return RuntimeError(
        f"schedule: group {group!r}, which recomputes in backward, recomputed differently from "
        f"its forward ({type(error).__name__}: {error}). {_CAUSE}"
    )


class _OutputsDiffer(Exception):
    def __init__(self, forward, recompute) -> None:
        super().__init__(
            f"the forward returned {_described(forward)}, the recompute {_described(recompute)}"
        )


def _described(meta) -> str:
    spec, tensors = meta
    shown = ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in tensors)
    return f"{spec} with tensors [{shown}]"


_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def without_cache(sub: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for a Hugging Face layer ``sub`` in a recomputed group: no cache
    (``use_cache=False``, its cache arguments ``None``, passed by keyword or position), as
    Hugging Face's own gradient checkpointing runs its layers; warns (once per layer class) when
    that changed anything. A layer without a cache (none in its signature, none given) and
    other modules get their arguments unchanged."""
    layers = sys.modules.get("transformers.modeling_layers")
    hf_layer = getattr(layers, "GradientCheckpointingLayer", None)
    if hf_layer is None or not isinstance(sub, hf_layer):
        return args, kwargs
    try:
        bound = _signature(type(sub).forward).bind(sub, *args, **kwargs)
    except (TypeError, ValueError):  # the call fails as it is: let the forward say why
        return args, kwargs
    named = {**bound.arguments, **bound.arguments.get(_var_keyword(bound), {})}
    # a layer that names no cache and is given none (Whisper's encoder layers, which get
    # use_cache only inside **kwargs, passed on to a model-wide call) writes no cache
    declared = bound.signature.parameters
    cached = any(k in declared for k in ("use_cache", *_CACHE_ARGS)) or any(
        named.get(k) is not None for k in _CACHE_ARGS
    )
    changed = {"use_cache": False} if named.get("use_cache") and cached else {}
    if not getattr(sub, "_can_checkpoint_with_cache", False):  # a layer that only reads it
        changed |= {k: None for k in _CACHE_ARGS if named.get(k) is not None}
    if not changed:
        return args, kwargs
    shown = ", ".join(f"{k}={v}" for k, v in changed.items())
    warnings.warn(
        f"funcshard: {type(sub).__name__} recomputes in backward, and its cache would be "
        f"written a second time by the recompute: running it with {shown}, as Hugging "
        "Face's gradient checkpointing does. Pass use_cache=False to the model (or set "
        "model.config.use_cache = False) to say so.",
        stacklevel=3,
    )
    extra = _var_keyword(bound)
    for k, v in changed.items():
        if k in bound.arguments and k != extra:
            bound.arguments[k] = v
        else:
            bound.arguments.setdefault(extra, {})[k] = v
    return bound.args[1:], bound.kwargs


@functools.cache
def _signature(forward: Callable) -> inspect.Signature:
    """A layer's forward's signature, read once per class (it is bound at every call)."""
    return inspect.signature(forward)


def _var_keyword(bound: inspect.BoundArguments) -> str | None:
    """The name of the ``**kwargs`` parameter of ``bound``'s signature, if any."""
    kinds = ((n, p.kind) for n, p in bound.signature.parameters.items())
    return next((n for n, k in kinds if k is inspect.Parameter.VAR_KEYWORD), None)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(x, torch.Tensor)]


def _arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a torch function's arguments (at the top level or in a list: ``cat``),
    looked for without a tree walk: this runs for every torch function of a checked call."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


# factories whose result's values do not depend on their arguments' values
_SHAPE_ONLY = re.compile(r"(^new_|_like$)")


class _Provenance(TorchFunctionMode):
    """While a recompute group's forward runs: ``made``, the tensors it computes (or updates in
    place) from its inputs, weakly held (``{id: weakref}``): those alive after the forward are
    kept as state. Plain weak references, no callbacks: this runs for every torch function."""

    def __init__(self, inputs) -> None:
        super().__init__()
        self.inputs = {id(t) for t in inputs}
        self.made: dict[int, weakref.ref] = {}
        self.shape_only: dict[Any, bool] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Size) or not isinstance(out, (torch.Tensor, tuple, list)):
            return out  # .shape, .dim(), ...: no tensor
        shape_only = self.shape_only.get(func)
        if shape_only is None:
            name = getattr(func, "__name__", "")
            shape_only = self.shape_only[func] = bool(_SHAPE_ONLY.search(name))
        if shape_only or not any(map(self._derived, _arguments(args, kwargs))):
            return out
        written = [out] if isinstance(out, torch.Tensor) else _tensors((out, kwargs.get("out")))
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
            written += _arguments(args[:1], {})  # updated in place
        for t in written:
            if id(t) not in self.inputs:
                self.made[id(t)] = weakref.ref(t)
        return out

    def _derived(self, t: torch.Tensor) -> bool:
        return id(t) in self.inputs or _alive(self.made, t)


def _alive(made: dict[int, weakref.ref], t: torch.Tensor) -> bool:
    """``t`` is one of the tensors ``made`` refers to (an id of a dead one may be reused)."""
    ref = made.get(id(t))
    return ref is not None and ref() is t


class _Unkept(TorchFunctionMode):
    """While a recompute runs: reading a tensor its forward computed and kept is an error."""

    def __init__(self, made: dict[int, weakref.ref] | None, group: str) -> None:
        super().__init__()
        self.made, self.group = made or {}, group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _arguments(args, kwargs):
            if _alive(self.made, t):
                raise differed(
                    self.group,
                    _StateRead(
                        f"the recompute read a tensor of shape {tuple(t.shape)} that the "
                        "forward computed from its inputs and kept"
                    ),
                )
        return func(*args, **kwargs)


class _StateRead(Exception):
    pass


def prepared(sub: nn.Module, forward: Callable, args, kwargs) -> tuple:
    """``(call, tensors, resolvers)`` for one call of ``sub``: the :class:`_Call`, the call's
    tensors (its tensor arguments, then the tensors bound to its parameters and buffers, the
    group's full tensors resolved: its turn in the plan, see _deferred), and the resolvers to
    release once it ran."""
    leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
    at = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    slots: dict[int, tuple[torch.Tensor, list[str]]] = {}  # one input per distinct tensor
    for slot, t in _one_per_slot(sub, dict(_named_state(sub))).items():
        slots.setdefault(id(t), (t, []))[1].append(slot)
    buffers = {n for n, _ in sub.named_buffers(remove_duplicate=False)}
    inputs = [leaves[i] for i in at] + [t for t, _ in slots.values()]
    for i in at:
        leaves[i] = None  # the call keeps no tensor: they are the Function's inputs
    real, resolvers = resolve_all(inputs)
    try:
        call = _Call(
            sub,
            forward,
            (spec, leaves, at),
            tuple(tuple(names) for _, names in slots.values()),
            tuple(any(n in buffers for n in names) for _, names in slots.values()),
            real,
        )
    except BaseException:
        release_all(resolvers)
        raise
    return call, real, resolvers


def _resolvers(sub: nn.Module) -> list:
    """Who answers for ``sub``'s deferred parameters (the scheduled call's run)."""
    return [t._resolver for _, t in _named_state(sub) if isinstance(t, Deferred)]


def _named_state(sub: nn.Module):
    return itertools.chain(
        sub.named_parameters(remove_duplicate=False), sub.named_buffers(remove_duplicate=False)
    )


class _Call:
    """What one recomputed call needs besides its tensors. Held by the autograd node, it holds
    nothing of the scheduler's per-call state (see [Note: per-call state is not reachable from
    the graph] in ``_schedule``).

    ``args``: the flattened arguments' spec, their non-tensor leaves, the tensors' positions;
    ``names``: each state tensor's slot names in the module; ``is_buffer``: which are buffers."""

    def __init__(self, module, forward, args, names, is_buffer, tensors) -> None:
        self.module, self.forward = module, forward
        self.spec, self.leaves, self.at = args
        self.names, self.is_buffer = names, is_buffer
        self.out_spec = self.out_at = self.out_leaves = self.differentiable = None
        self.group: str | None = None  # a recompute group's call: its recompute is checked
        self.made: dict[int, weakref.ref] | None = None  # see _Provenance
        self.out_meta: tuple | None = None
        self.cpu_rng = torch.get_rng_state()
        self.device_type = DefaultDeviceType.get_device_type()
        self.devices, self.device_rng = get_device_states(*tensors)
        self.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
            for d in _AUTOCAST_DEVICES
        ]

    @contextlib.contextmanager
    def bound(self, tensors) -> Iterator[None]:
        """The module's parameters and buffers bound to the state part of ``tensors``."""
        state = tensors[len(self.at) :]
        bound = {name: t for ns, t in zip(self.names, state, strict=True) for name in ns}
        with _reparametrize_module(self.module, bound):
            yield

    def run(self, tensors) -> tuple[torch.Tensor, ...]:
        """The module's forward on ``tensors`` (arguments, then state; bound by the caller):
        its output tensors."""
        leaves = list(self.leaves)
        for i, t in zip(self.at, tensors, strict=False):
            leaves[i] = t
        args, kwargs = optree.tree_unflatten(self.spec, leaves)
        first = self.out_spec is None
        if self.group is None:
            result = self.forward(*args, **kwargs)
        elif first:  # the forward: which tensors it computes from its inputs
            with _Provenance(tensors) as provenance:
                result = self.forward(*args, **kwargs)
            self.made = provenance.made
        else:  # the recompute: reads none of those the forward kept
            with _Unkept(self.made, self.group):
                result = self.forward(*args, **kwargs)
        out_leaves, out_spec = optree.tree_flatten(result, none_is_leaf=True)
        out = tuple(x for x in out_leaves if isinstance(x, torch.Tensor))
        meta = (out_spec, tuple((t.shape, t.dtype) for t in out))
        if self.group is not None and not first and meta != self.out_meta:
            raise differed(self.group, _OutputsDiffer(self.out_meta, meta))
        self.out_meta = meta
        if first:
            self.out_spec = out_spec
            # the tensors' positions are kept apart from the other leaves: any leaf (None
            # among them: T5's blocks return (hidden, bias, None)) comes back as it was
            self.out_at = tuple(i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor))
            self.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
            self.differentiable = tuple(_differentiable(t) for t in out)
        return out

    def outputs(self, tensors) -> Any:
        """The module's output, from the Function's output tensors."""
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_at, tensors, strict=True):
            leaves[i] = t
        return optree.tree_unflatten(self.out_spec, leaves)

    def copied_buffers(self, tensors: list) -> list:
        """``tensors`` with the buffers copied: updated in place once, by the forward (see the
        Note). Copied where the recompute runs (inside ``torch.func.vjp``'s level, which refuses
        in-place updates of a tensor from outside it)."""
        n = len(self.at)
        return [t.clone() if j >= n and self.is_buffer[j - n] else t for j, t in enumerate(tensors)]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """The forward's RNG states and autocast settings."""
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            with contextlib.ExitStack() as stack:
                for device, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device, dtype, enabled))
                yield


class _Recompute(torch.autograd.Function):
    """``forward(call, *tensors)``: the module's output tensors, keeping only ``tensors``;
    ``backward``: recompute and take the vector-Jacobian product. See [Note: recompute as part
    of the plan]."""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with call.bound(tensors):
            out = call.run(tensors)
        # an input returned as it is (T5's blocks pass the position bias on) leaves as a view:
        # autograd refuses an input both returned as it is and saved
        inputs = {id(t) for t in tensors}
        return tuple(t.view_as(t) if id(t) in inputs else t for t in out)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        call, *tensors = inputs
        ctx.call = call
        ctx.save_for_backward(*tensors)  # with reshard: freed, re-gathered on unpack
        ctx.mark_non_differentiable(*(t for t in output if not _differentiable(t)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        tensors = list(ctx.saved_tensors)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        with call.replay():
            found = _vjp(call, tensors, wanted, grads)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for i, g in zip(wanted, found, strict=True):
            out[i] = g
        return (None, *out)


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _vjp(call: _Call, tensors: list, wanted: list[int], grads) -> tuple:
    """Gradients of the recomputed outputs (weighted by ``grads``) for ``tensors[wanted]``."""
    if not wanted:
        return ()
    grads = [
        g for g, d in zip(grads, call.differentiable, strict=True) if d
    ]  # non-differentiable outputs get no gradient
    if not transformed():  # plain autograd
        inputs = list(tensors)
        for i in wanted:
            inputs[i] = tensors[i].detach().requires_grad_()
        leaves = inputs
        inputs = call.copied_buffers(leaves)
        with torch.enable_grad(), call.bound(inputs):  # bound until the grads are taken
            outs = [o for o in call.run(inputs) if _differentiable(o)]
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            if not pairs:
                return (None,) * len(wanted)
            return torch.autograd.grad(
                [o for o, _ in pairs],
                [leaves[i] for i in wanted],
                [torch.zeros_like(o) if g is None else g for o, g in pairs],
                allow_unused=True,
            )

    def differentiated(*chosen):
        inputs = list(tensors)
        for i, t in zip(wanted, chosen, strict=True):
            inputs[i] = t
        inputs = call.copied_buffers(inputs)
        with call.bound(inputs):
            return tuple(o for o in call.run(inputs) if _differentiable(o))

    outs, vjp_fn = torch.func.vjp(differentiated, *(tensors[i] for i in wanted))
    return vjp_fn(
        tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads, strict=True))
    )
