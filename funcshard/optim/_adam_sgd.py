"""Adam, AdamW and SGD on sharded trees, computed by torch.optim's own functional kernels.

The kernels (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``) run on the *local* shards of the
parameters, gradients and state (``DTensor.to_local()`` shares storage), with ``foreach`` chosen
as ``torch.optim`` chooses it, so every number is what ``torch.optim.Adam/AdamW/SGD`` computes
on the same shards. Gradients that are ``None`` (frozen parameters) get no update and leave their
state as it is.

[Note: updates as differences]
The pure ``update`` runs a kernel on a copy ``q`` of the parameters and returns ``q - p``. When
``q`` and ``p`` are within a factor 2 of each other (any step that does not flip a weight's sign
or move it across an order of magnitude) that subtraction is exact (Sterbenz), and
``apply_updates`` then gives back ``q`` bit for bit; otherwise they differ by at most an ulp.
``fs.optim.step`` applies the kernel to ``p`` directly.

[Note: momentum buffers start at zero]
``torch.optim.SGD`` creates its momentum buffer on the first step as a copy of the gradient. The
state here exists from ``init`` (so a checkpoint of it always has the same keys), filled with
zeros: with ``dampening == 0``, ``0 * momentum + 1 * grad`` is that copy exactly. With
``dampening != 0`` the first step hands the kernel no buffers, as torch.optim does, and keeps the
ones it creates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_capturable_supported_devices, _get_scalar_dtype
from torch.optim.sgd import sgd as torch_sgd

from .._runtime._compile import compiling
from .._runtime._mode import capturing
from .._trees._tree import Flat, PyTree, flatten, map_with_path
from . import _opaque as opaque
from ._base import (
    EmptyState,
    GradientTransformation,
    check_like,
    local,
    locals_of,
    without_grad,
    wrap,
)
from ._masked import Mask, resolve

# a number, a 0-dim tensor (read at every step, as torch.optim reads a tensor lr), or a schedule:
# step count (an int; under torch.compile, a 0-dim int64 tensor) -> lr
LearningRate = float | torch.Tensor | Callable[[Any], float | torch.Tensor]


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`: ``count`` (int64, updates done so far: the step
    the learning-rate schedule sees), ``mu`` and ``nu`` (first and second moments,
    ``exp_avg``/``exp_avg_sq`` in torch.optim: trees like the parameters, DTensors with their
    placements; ``None`` for non-floating-point parameters) and ``steps`` (torch.optim's
    per-parameter ``step``: a tree of 0-dim float tensors counting the updates each leaf got,
    which its bias correction uses; see [Note: a step count per leaf])."""

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    steps: PyTree


class SgdState(NamedTuple):
    """State of :func:`sgd`: ``count`` (int64) and the momentum buffers (a tree like the
    parameters), or ``None`` when ``momentum == 0``."""

    count: torch.Tensor
    momentum: PyTree | None


@dataclasses.dataclass(frozen=True)
class _Hyper:
    name: str
    lr: LearningRate
    weight_decay: float
    mask: Mask | None
    foreach: bool | None
    options: tuple[tuple[str, Any], ...]  # the kernel's own keyword arguments
    capturable: bool = False  # see [Note: counts on the device]

    @functools.cached_property
    def kernel(self) -> dict[str, Any]:
        """``options`` as keyword arguments (made once: every step reads them)."""
        return dict(self.options)


def adam(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    mask: Mask | None = None,
    foreach: bool | None = None,
    fused: bool | None = None,
    capturable: bool = False,
) -> GradientTransformation:
    """Adam as ``torch.optim.Adam`` computes it (weight decay added to the gradient, L2).

    Args:
        lr: a number, a one-element tensor (read at every step), or a schedule ``step -> lr``
            evaluated at the state's ``count`` (0 for the first update), like a ``LambdaLR``
            stepped after each update.
        betas, eps, weight_decay: as in ``torch.optim.Adam``.
        mask: which parameters get weight decay: ``fn(path, param) -> bool`` (e.g.
            :func:`at_least_2d`) or a tree of bools; default all. As two ``torch.optim``
            parameter groups, one with ``weight_decay=0``.
        foreach: as in ``torch.optim``; ``None`` lets torch choose (foreach kernels on CUDA, a
            loop over tensors on CPU).
        fused: as in ``torch.optim``: ``True`` runs torch's fused kernel (one kernel for all
            the shards of a dtype and device; CUDA, and CPU for floating dtypes), what
            ``torch.optim.AdamW(fused=True)`` computes; not with ``foreach=True``. Under
            ``torch.compile`` the kernel runs as one operation of the graph (see [Note: the
            optimizer in a compiled step]). On a GPU the step counts then live on the device (see
            [Note: counts on the device]).
        capturable: as in ``torch.optim``: the step counts (``count``, ``steps``) are tensors on
            the parameters' device, updated by the step itself, and the learning rate and bias
            corrections are computed there, so the step can be captured into a CUDA graph
            (:func:`funcshard.cuda_graph`); on CUDA torch's ``capturable=True`` kernel runs. On
            CPU the counts stay CPU tensors read by the same path (torch has no capturable CPU
            kernel).

    Raises:
        ValueError: a negative ``lr``/``eps``/``weight_decay`` or a beta outside ``[0, 1)``;
        TypeError: an ``lr`` that is no number, one-element tensor or callable.
    """
    return _adam(
        "adam", lr, betas, eps, weight_decay, mask, foreach, fused, capturable, decoupled=False
    )


def adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Mask | None = None,
    foreach: bool | None = None,
    fused: bool | None = None,
    capturable: bool = False,
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW`` computes it (decoupled weight decay: ``p *= 1 - lr * wd``).

    Arguments as for :func:`adam`; ``mask`` selects the parameters that are decayed.
    """
    return _adam(
        "adamw", lr, betas, eps, weight_decay, mask, foreach, fused, capturable, decoupled=True
    )


def _adam(
    name, lr, betas, eps, weight_decay, mask, foreach, fused, capturable, decoupled
) -> GradientTransformation:
    lr = _check_lr(name, lr)
    _check(name, "eps", eps, eps >= 0, ">= 0")
    _check(name, "weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    for i, b in enumerate(betas):
        _check(name, f"betas[{i}]", b, 0 <= b < 1, "in [0, 1)")
    options = dict(
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(eps),
        decoupled_weight_decay=decoupled,
        amsgrad=False,
        maximize=False,
        fused=fused,
    )
    hp = _Hyper(
        name, lr, float(weight_decay), mask, foreach, tuple(options.items()), bool(capturable)
    )
    return GradientTransformation(
        functools.partial(_adam_init, hp),
        functools.partial(_adam_update, hp, inplace=False),
        functools.partial(_adam_update, hp, inplace=True),
    )


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    mask: Mask | None = None,
    foreach: bool | None = None,
) -> GradientTransformation:
    """SGD as ``torch.optim.SGD`` computes it: momentum, dampening, Nesterov, L2 weight decay.

    Arguments as in ``torch.optim.SGD``; ``lr``, ``mask`` and ``foreach`` as for :func:`adam`.

    Raises:
        ValueError: negative ``lr``/``momentum``/``weight_decay``, or ``nesterov`` without
            momentum or with dampening.
    """
    lr = _check_lr("sgd", lr)
    _check("sgd", "momentum", momentum, momentum >= 0, ">= 0")
    _check("sgd", "weight_decay", weight_decay, weight_decay >= 0, ">= 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd: nesterov=True needs momentum > 0 and dampening == 0 (as torch's).")
    options = dict(
        momentum=float(momentum), dampening=float(dampening), nesterov=nesterov, maximize=False
    )
    hp = _Hyper("sgd", lr, float(weight_decay), mask, foreach, tuple(options.items()))
    return GradientTransformation(
        functools.partial(_sgd_init, momentum != 0),
        functools.partial(_sgd_update, hp, inplace=False),
        functools.partial(_sgd_update, hp, inplace=True),
    )


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """``grads + weight_decay * params`` (L2 regularisation, as torch's SGD and Adam add it).

    ``chain(add_decayed_weights(wd), sgd(lr))`` is ``sgd(lr, weight_decay=wd)``; wrap it in
    :func:`masked` to decay only some parameters. Needs ``params``.
    """
    _check("add_decayed_weights", "weight_decay", weight_decay, weight_decay >= 0, ">= 0")

    @without_grad
    def update(grads, state, params=None, inplace=False):
        s, _ = _pair("add_decayed_weights", grads, params)
        gs, ps = locals_of(s.active, s.grads, s.params)
        if inplace:
            torch._foreach_add_(gs, ps, alpha=weight_decay)
        else:
            gs = torch._foreach_add(gs, ps, alpha=weight_decay) if gs else []
        out = list(s.grads)
        for i, g in zip(s.active, gs, strict=True):
            out[i] = wrap(g, s.grads[i])
        return s.rebuild(out), state

    return GradientTransformation(
        lambda params: EmptyState(),
        update,
        functools.partial(update, inplace=True),
    )


@dataclasses.dataclass
class _Pairs:
    flat: Flat  # the params
    grads: list[Any]
    active: list[int]  # leaves with a gradient

    @property
    def params(self) -> list[Any]:
        return self.flat.leaves

    @property
    def tree(self) -> PyTree:
        return self.flat.tree

    @functools.cached_property
    def paths(self) -> list[str]:  # read only for an error
        return flatten(self.tree, none_is_leaf=True)[0]

    def rebuild(self, leaves: list) -> PyTree:
        """A tree of the params' structure with ``leaves`` (in their order)."""
        return self.flat.rebuild(leaves)

    def of_active(self, leaves: list) -> list:
        """The entries of ``leaves`` (in the params' order) that have a gradient."""
        return leaves if len(self.active) == len(leaves) else [leaves[i] for i in self.active]


def _pair(fn: str, grads, params, state: dict | None = None) -> tuple[_Pairs, dict[str, list]]:
    """Grads, params and state trees paired leaf by leaf (the state's as ``{field: leaves}``),
    with their layouts checked.

    [Note: the common step checked in one pass]
    A training step passes the gradients of ``fs.value_and_grad`` and the state of ``init``:
    DTensors that share their parameter's spec (see [Note: one DTensorSpec per layout] in
    ``_trees/_dtensor``: the spec holds the global shape, stride, placements and dtype), so
    "placed like the parameter" is one identity test per leaf. When every parameter has a
    gradient and every leaf is such a DTensor, the lists of specs are compared whole (list
    equality tests identity first); otherwise the leaves are checked one by one, and only a
    leaf of another kind goes through :func:`check_like`. The trees are flattened without their
    key paths, which are read only for an error. On a host-bound step this was most of the
    optimizer's Python."""
    if params is None:
        raise ValueError(
            f"{fn}: update needs params (torch's kernels compute the update from them): "
            "call opt.update(grads, state, params)."
        )
    pairs = _Pairs(Flat.of(params), [], [])  # see [Note: a dict of tensors is flattened ...]
    ps = pairs.params
    pairs.grads = pairs.flat.paired(grads, what="grads", like_what="params")
    fields = {
        k: pairs.flat.paired(v, what=f"{fn} state.{k}", like_what="params")
        for k, v in (state or {}).items()
    }
    columns = list(fields.values())
    specs = _specs(ps)  # see [Note: the common step checked in one pass]
    if specs is not None and all(_specs(c) == specs for c in (pairs.grads, *columns)):
        pairs.active = list(range(len(ps)))
        return pairs, fields
    active, odd = pairs.active, []
    for i, (p, g) in enumerate(zip(ps, pairs.grads, strict=True)):
        if g is None:
            continue
        active.append(i)
        s = p._spec if type(p) is DTensor else None  # see [Note: the common step checked ...]
        if s is None or type(g) is not DTensor or g._spec is not s:
            odd.append(i)
            continue
        for column in columns:
            x = column[i]
            if type(x) is not DTensor or x._spec is not s:
                odd.append(i)
                break
    for i in odd:
        p, g, path = ps[i], pairs.grads[i], pairs.paths[i]
        if p is None:
            raise TypeError(f"{fn}: grads[{path!r}] has no parameter (it is None).")
        for field, leaves in fields.items():
            if leaves[i] is None:
                raise ValueError(
                    f"{fn}: grads[{path!r}] is a gradient, but the optimizer state has no entry "
                    "for it (init saw a non-floating-point or None parameter there, or a mask "
                    "left it out); initialize the state from the parameters that are trained."
                )
            check_like(fn, path, leaves[i], p, f"state.{field}", dtype=True)
        check_like(fn, path, g, p, "grads", dtype=True)
    return pairs, fields


# what the checks read from every leaf, list by list (see [Note: the common step checked ...])
_SPEC, _DTYPE, _DEVICE = (operator.attrgetter(a) for a in ("_spec", "dtype", "device"))
_TENSORS = frozenset({torch.Tensor})


def _specs(leaves: list) -> list | None:
    """The specs of ``leaves`` if every one is a DTensor (so none is ``None``), else ``None``."""
    try:
        return list(map(_SPEC, leaves))
    except AttributeError:  # not a DTensor
        return None


def _groups(hp: _Hyper, pairs: _Pairs) -> list[tuple[float, list[int]]]:
    """Active leaves split by weight decay, as two torch.optim parameter groups would be."""
    if hp.mask is None or hp.weight_decay == 0:
        return [(hp.weight_decay, pairs.active)]
    decay = resolve(hp.mask, pairs.tree, hp.name)
    return [
        (hp.weight_decay, [i for i in pairs.active if decay[i]]),
        (0.0, [i for i in pairs.active if not decay[i]]),
    ]


def _adam_init(hp: _Hyper, params: PyTree) -> AdamState:
    """[Note: a step count per leaf]
    ``torch.optim.Adam`` keeps a ``step`` per parameter and counts only the steps in which the
    parameter had a gradient: one that was frozen (``grad is None``) for a while gets the bias
    correction of the updates it actually had when it trains again. ``steps`` holds those counts
    (float tensors, as torch's), handed to torch's kernel, which increments them; ``count`` counts
    every update (the step of the learning-rate schedule, as a ``LambdaLR``'s ``last_epoch``).
    """
    device = _device_of(flatten(params)[1])
    on_device = device is not None and _on_device(hp, device)
    steps = map_with_path(
        lambda _, p: (
            torch.zeros((), dtype=_get_scalar_dtype(), device=p.device if on_device else None)
            if p.is_floating_point()
            else None
        ),
        params,
    )
    count = _count(device if on_device else None)
    return AdamState(count, _zeros(params), _zeros(params), steps)


@without_grad
def _adam_update(hp: _Hyper, grads, state, params=None, *, inplace: bool):
    _check_state(hp.name, state, AdamState)
    pairs, fields = _pair(hp.name, grads, params, {"mu": state.mu, "nu": state.nu})
    steps = _leaf_steps(hp.name, state, pairs)
    device = _device_of(pairs.params[i] for i in pairs.active)
    on_device = device is not None and _on_device(hp, device) and not compiling()
    if on_device:  # see [Note: counts on the device]
        state, steps = _counts_to(hp.name, state, steps, pairs, device)
        count = state.count
        lr = _device_lr(hp, count, device)
        device_kw = {"capturable": _capturable_kernel(hp, device)}
    else:
        count = _count_of(hp.name, state)
        lr = _lr_at(hp, count)
        device_kw = {}
    steps = _writable(steps, pairs.active, inplace)
    mu, nu = (
        _writable(fields["mu"], pairs.active, inplace),
        _writable(fields["nu"], pairs.active, inplace),
    )
    targets = _writable(pairs.params, pairs.active, inplace)
    traced = not on_device and isinstance(count, torch.Tensor)  # under torch.compile
    # traced with the counts on the device: the kernel an eager step asks for there
    capturable = traced and device is not None and _capturable_kernel(hp, device) and all(
        steps[i].device == device for i in pairs.active
    )  # fmt: skip
    for weight_decay, idx in _groups(hp, pairs):
        lists = locals_of(idx, targets, pairs.grads, mu, nu)
        leaf_steps = [steps[i] for i in idx]  # incremented by the kernel
        if traced:  # see [Note: the optimizer in a compiled step]
            kw = dict(lr=lr, weight_decay=weight_decay, foreach=hp.foreach, options=hp.options)
            opaque.adam(*lists, leaf_steps, capturable=capturable, **kw)
            continue
        opaque.run_adam(
            *lists, leaf_steps, lr=lr, weight_decay=weight_decay, foreach=hp.foreach, **hp.kernel,
            **device_kw,
        )  # fmt: skip
    if inplace:
        state.count.add_(1)
        return _no_updates(pairs), state
    trees = (pairs.rebuild(t) for t in (mu, nu, steps))
    return _differences(pairs, targets), AdamState(state.count + 1, *trees)


def _sgd_init(has_momentum: bool, params: PyTree) -> SgdState:
    return SgdState(_count(), _zeros(params) if has_momentum else None)


@without_grad
def _sgd_update(hp: _Hyper, grads, state, params=None, *, inplace: bool):
    _check_state(hp.name, state, SgdState)
    has_momentum = hp.kernel["momentum"] != 0
    if (state.momentum is not None) != has_momentum:
        raise TypeError(
            "sgd: the state's momentum buffers do not match this optimizer's momentum; pass the "
            "state that this optimizer's init returned."
        )
    trees = {"momentum": state.momentum} if has_momentum else {}
    pairs, fields = _pair(hp.name, grads, params, trees)
    count = _count_of(hp.name, state)
    lr = _lr_at(hp, count)
    fresh = has_momentum and hp.kernel["dampening"] != 0 and _first(hp, count)
    bufs = [None] * len(pairs.params)
    if has_momentum:
        bufs = _writable(fields["momentum"], pairs.active, inplace or fresh)
    targets = _writable(pairs.params, pairs.active, inplace)
    opts = hp.kernel
    for weight_decay, idx in _groups(hp, pairs):
        # the foreach Nesterov kernel adds into the gradients when there is no weight decay
        copy = not inplace and opts["nesterov"] and weight_decay == 0
        given = [None if fresh or b is None else local(b) for b in (bufs[i] for i in idx)]
        (ps,) = locals_of(idx, targets)
        if isinstance(count, torch.Tensor):  # see [Note: the optimizer in a compiled step]
            (gs,) = locals_of(idx, pairs.grads)
            kw = dict(lr=lr, weight_decay=weight_decay, foreach=hp.foreach, options=opts)
            opaque.sgd(ps, gs, [b for b in given if b is not None], **kw)
            continue
        torch_sgd(
            ps,
            [local(pairs.grads[i]).clone() if copy else local(pairs.grads[i]) for i in idx],
            given,
            foreach=hp.foreach,
            lr=lr,
            weight_decay=weight_decay,
            **opts,
        )
        if fresh:  # see [Note: momentum buffers start at zero]
            for i, b in zip(idx, given, strict=True):
                if inplace:
                    local(bufs[i]).copy_(b)
                else:
                    bufs[i] = wrap(b, bufs[i])
    if inplace:
        state.count.add_(1)
        return _no_updates(pairs), state
    momentum = pairs.rebuild(bufs) if has_momentum else None
    return _differences(pairs, targets), SgdState(state.count + 1, momentum)


def _writable(leaves: list, active: list[int], inplace: bool) -> list:
    """``leaves`` itself (donated), or with the active ones copied (pure)."""
    if inplace:
        return leaves
    out = list(leaves)
    for i in active:
        out[i] = wrap(local(leaves[i]).clone(), leaves[i])
    return out


def _differences(pairs: _Pairs, targets: list) -> PyTree:
    """Updates ``targets - params``, computed in the targets' storage (see
    [Note: updates as differences])."""
    out: list[Any] = [None] * len(pairs.params)
    for i in pairs.active:
        local(targets[i]).sub_(local(pairs.params[i]))
        out[i] = targets[i]
    return pairs.rebuild(out)


def _no_updates(pairs: _Pairs) -> PyTree:
    return pairs.flat.nones()


@without_grad
def _zeros(params: PyTree) -> PyTree:
    """Zeros like each floating-point parameter (placed like it: its own spec, see [Note: one
    DTensorSpec per layout] in ``_trees/_dtensor``), ``None`` for the others."""
    return map_with_path(
        lambda _, p: wrap(torch.zeros_like(local(p)), p) if p.is_floating_point() else None,
        params,
    )


def _count(device: torch.device | None = None) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _device_of(leaves: Iterable) -> torch.device | None:
    """The device of the first floating-point tensor among ``leaves`` (a DTensor's local one)."""
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return local(x).device
    return None


def _on_device(hp: _Hyper, device: torch.device) -> bool:
    """Whether this optimizer keeps its step counts on ``device``.

    [Note: counts on the device]
    By default the count and the per-leaf steps are CPU tensors, read on the host (torch.optim's
    default too): a schedule gets an int, the kernel the bias corrections as numbers. With
    ``capturable=True``, or ``fused=True`` on a GPU (torch's fused kernel reads its steps on the
    device), ``init`` puts them on the parameters' device and no step reads them on the host:
    the kernel increments the steps, ``count.add_(1)`` the count, a schedule is called with the
    count tensor (see [Note: schedules of a tensor count] in ``_schedules``) and its 0-dim result
    (float32, as torch.optim holds a tensor lr) goes to the kernel on the device, where torch's
    ``capturable=True`` kernel computes the bias corrections. The step is then the same on every
    call whatever the counts say, which a CUDA graph needs (see [Note: no capture of host
    counts]), and it waits for nothing on the host. A state made with host counts (a checkpoint
    of an optimizer without these options) is moved to the device by its first eager step. On
    CPU the same path runs with CPU counts (a number is read from them: torch has no capturable
    CPU kernel), which lets CPU tests check it against the host path.
    """
    return hp.capturable or (bool(hp.kernel.get("fused")) and device.type != "cpu")


def _capturable_kernel(hp: _Hyper, device: torch.device) -> bool:
    """torch's ``capturable=`` for the kernel: its device-count arithmetic where torch has it
    (not for the fused kernel, which reads device counts anyway, nor on CPU)."""
    fused = bool(hp.kernel.get("fused"))
    return hp.capturable and not fused and device.type in _get_capturable_supported_devices()


def _counts_to(
    name: str, state, steps: list, pairs: _Pairs, device: torch.device
) -> tuple[Any, list]:
    """``state`` with its count and the active leaves' steps on ``device``, and its steps: as
    they are when they are there already, else moved (a state saved with host counts, or made
    by an optimizer without ``capturable``/``fused``).

    Raises:
        RuntimeError: they must move while a CUDA graph is being captured.
    """
    if state.count.device == device and set(map(_DEVICE, pairs.of_active(steps))) <= {device}:
        return state, steps
    moved = [i for i in pairs.active if steps[i].device != device]
    if capturing():
        where = state.count.device if state.count.device != device else steps[moved[0]].device
        raise RuntimeError(
            f"{name}: the optimizer state's step counts are on {where}, but this optimizer "
            f"keeps them on the parameters' device ({device}) and the step is being captured "
            "into a CUDA graph, where they cannot be moved (a state saved with host counts, or "
            "made by an optimizer without capturable=True). Run one step before the capture "
            "(it moves them), or make the state with this optimizer's init."
        )
    new = list(steps)
    for i in moved:
        new[i] = steps[i].to(device)
    return state._replace(count=state.count.to(device), steps=pairs.rebuild(new)), new


def _device_lr(hp: _Hyper, count: torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """The learning rate of an update whose count is a tensor on ``device``: a number as it is;
    a schedule's value, computed from the count by torch ops, as a 0-dim float32 tensor on the
    device (on CPU: as it is for the fused kernel, else a number); a tensor ``lr`` read there
    at every step.

    Raises:
        RuntimeError: a CPU tensor ``lr`` while a CUDA graph is captured (a replay would not read
            it).
    """
    if isinstance(hp.lr, float):
        return hp.lr
    if isinstance(hp.lr, torch.Tensor):
        value = hp.lr.detach().reshape(())
        if value.device != device and capturing():
            raise RuntimeError(
                f"{hp.name}: lr is a tensor on {value.device} but the step is being captured "
                f"into a CUDA graph on {device}, whose replays would not read it; put the lr "
                f"tensor on {device} (and change it in place between steps), or pass a number "
                "or a schedule."
            )
    else:
        value = _traced_lr(hp, count)
        if not isinstance(value, torch.Tensor):
            return value
    if device.type != "cpu":
        return value.to(device=device, dtype=_get_scalar_dtype())
    if hp.kernel.get("fused"):
        return value  # torch's fused CPU kernel reads it itself
    return _checked_lr(hp, "this step", float(value))


def _count_of(name: str, state) -> int | torch.Tensor:
    """The number of updates done, as an int; under ``torch.compile``, the state's tensor
    itself, so that the graph reads it at run time.

    Raises:
        RuntimeError: called while a CUDA graph is being captured (see [Note: no capture of
            host counts]).

    [Note: the step count under torch.compile]
    Converting the count to a Python number while tracing would bake it into the graph (a
    guard, and a recompilation at every step). Traced, it stays a tensor: the update runs as an
    operation of the graph that reads the per-leaf steps at run time (see [Note: the optimizer
    in a compiled step] in ``_opaque``), a learning rate given as a number does not depend on
    it, and a schedule is called with the tensor (see [Note: a schedule under torch.compile]).
    """
    if compiling():
        return state.count
    if capturing():
        # [Note: no capture of host counts]
        # The count and the per-leaf steps are CPU tensors, read and incremented on the host:
        # a CUDA graph records only the device work, so every replay would repeat the captured
        # step's bias correction and learning rate while the counts stay put. torch.optim
        # refuses such a capture too (unless capturable=True).
        raise RuntimeError(
            f"{name}: the optimizer step is being captured into a CUDA graph, but its step "
            "counts live on the host, which a graph replay does not update (every replay would "
            "reuse the captured step's bias correction and learning rate). Make the optimizer "
            "with capturable=True (adam, adamw: the counts on the device), or capture the "
            "forward and backward only and run fs.optim.step outside the graph."
        )
    return int(state.count)


def _first(hp: _Hyper, count) -> bool:
    if isinstance(count, torch.Tensor):  # see [Note: the step count under torch.compile]
        raise NotImplementedError(
            f"{hp.name}: momentum with dampening creates its buffers on the first step, which a "
            "compiled step cannot tell from the others; use dampening=0, or keep the optimizer "
            "step out of torch.compile."
        )
    return count == 0


def _leaf_steps(name: str, state: AdamState, pairs: _Pairs) -> list:
    """The state's per-leaf step counts in ``pairs``' order, checked to be 0-dim tensors."""
    steps = pairs.flat.paired(state.steps, what=f"{name} state.steps", like_what="params")
    active = pairs.of_active(steps)
    if (
        _TENSORS.issuperset(map(type, active))
        and set(map(torch.Tensor.dim, active)) <= {0}
        and all(d.is_floating_point for d in set(map(_DTYPE, active)))
    ):
        return steps  # the common case, checked list by list
    for i in pairs.active:
        t = steps[i]
        if not isinstance(t, torch.Tensor) or t.ndim != 0 or not t.is_floating_point():
            raise ValueError(
                f"{name}: state.steps[{pairs.paths[i]!r}] is {_show(t)}, not a 0-dim float "
                "tensor (the updates this parameter got); pass the state that init returned."
            )
    return steps


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def _lr_at(hp: _Hyper, count) -> float | torch.Tensor:
    """The learning rate of this update: a float, checked; under ``torch.compile`` with a
    schedule, the schedule's 0-dim tensor (see [Note: a schedule under torch.compile])."""
    if isinstance(count, torch.Tensor) and not isinstance(hp.lr, float):
        return _traced_lr(hp, count)
    value = hp.lr(count) if callable(hp.lr) else hp.lr
    return _checked_lr(hp, f"step {count}", value)


def _checked_lr(hp: _Hyper, when: str, value) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{hp.name}: the learning rate at {when} is {value}; it must be a finite "
            "number >= 0 (check the schedule)."
        )
    return value


def _traced_lr(hp: _Hyper, count: torch.Tensor) -> float | torch.Tensor:
    """The schedule called with the traced count.

    [Note: a schedule under torch.compile]
    The count is a traced tensor (see [Note: the step count under torch.compile]), so the
    schedule is called with it, as optax's schedules are called with a traced count under
    ``jax.jit``; fs.optim's schedules then compute with torch ops (see [Note: schedules of a
    tensor count] in ``_schedules``) and the graph computes the lr at every step from the count
    it reads. The update's operation (see [Note: the optimizer in a compiled step] in
    ``_opaque``) takes that 0-dim tensor: torch's fused kernels use it as it is, the others read
    it as a number at run time, so the formulas are the eager step's. A value is not a Python
    number at trace time, so a negative or non-finite lr from a schedule is not checked in a
    compiled step (eager steps check it); a schedule that returns a Python number is checked
    while tracing.
    """
    try:
        value = hp.lr(count) if callable(hp.lr) else hp.lr
    except Exception as e:
        raise TypeError(
            f"{hp.name}: the learning-rate schedule {_describe(hp.lr)} failed when called with "
            f"the step count as a tensor, as a step compiled by torch.compile calls it "
            f"({type(e).__name__}: {e}). Under torch.compile a schedule gets the count as a "
            "0-dim int64 tensor and must compute with torch ops (torch.where, torch.clamp, "
            "torch.cos; not int(step), math.cos or `if step < n`): write it so, or use "
            "fs.optim's schedules, which do; or run the optimizer step outside torch.compile "
            "(see docs/compile.md)."
        ) from e
    if not isinstance(value, torch.Tensor):
        return _checked_lr(hp, "a compiled step", value)  # it does not depend on the count
    if value.numel() != 1 or value.is_complex():
        raise TypeError(
            f"{hp.name}: the learning-rate schedule {_describe(hp.lr)} returned a "
            f"{value.dtype} tensor of shape {list(value.shape)}; it must return a number or a "
            "tensor with one real element."
        )
    value = value.detach().reshape(())
    return value if value.is_floating_point() else value.to(torch.float64)


def _describe(fn) -> str:
    if dataclasses.is_dataclass(fn):
        return repr(fn)
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_lr(name: str, lr) -> LearningRate:
    """``lr`` as kept: a number as a float (numpy scalars too), a tensor or schedule as given.

    Raises:
        TypeError: not a number, a one-element real tensor or a callable; ValueError: negative
            or not finite."""
    if callable(lr):
        return lr
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex() or lr.dtype == torch.bool:
            raise TypeError(
                f"{name}: lr is a {lr.dtype} tensor of shape {list(lr.shape)}; a tensor lr must "
                "hold one real number."
            )
        value = float(lr)
    elif isinstance(lr, numbers.Real) and not isinstance(lr, bool):
        value = lr = float(lr)
    else:
        raise TypeError(
            f"{name}: lr={lr!r} is a {type(lr).__name__}; pass a number, a one-element tensor or "
            "a schedule (step -> lr)."
        )
    _check(name, "lr", value, math.isfinite(value) and value >= 0, "a finite number >= 0")
    return lr


def _check(name: str, what: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}={value!r} is invalid; it must be {rule}.")


def _check_state(name: str, state, cls) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{name}: the state is a {type(state).__name__}, not the {cls.__name__} that "
            f"{name}'s init returns; pass the state of this optimizer (for a chain, the whole "
            "tuple of states)."
        )
