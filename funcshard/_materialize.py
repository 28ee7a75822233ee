"""``materialize``: a module built on the meta device -> initialised shards, one module at a time.

[Note: one module at a time]
No rank ever holds the whole model. Modules are visited one at a time; each gets fresh full
tensors for its *own* (non-recursive) parameters and buffers, swapped into the module in place of
its meta tensors, runs its ``reset_parameters()`` (then ``init``), and gives them back: parameters
are cut to this rank's chunk (by :func:`~funcshard.shard` itself), buffers are kept whole (as
``fs.extract`` returns them). The meta tensors are put back, so the module is left as it was: a
recipe for ``fs.schedule``, ties intact. Peak memory: the shards so far, plus one module's own
full tensors (plus, with ``init``, tied tensors until their last holder's ``init``). Every rank
runs the same random stream, so the ranks agree without communication.

[Note: the order of initialisation]
Modules are visited children first, as ``Module.apply`` visits them. Single-process construction
draws a module's random values when its ``__init__`` calls ``reset_parameters()``, which
``torch.nn`` layers do on their last line, after any children were built; so the order in which
``__init__``s *finish* is children before parents, in registration order. (For leaves this is
also ``named_modules()`` order; the two differ only for a module with tensors of its own *and*
children, such as ``nn.MultiheadAttention``'s ``in_proj_weight`` drawn after ``out_proj``.)
What cannot be replayed from a meta module: random values drawn outside any
``reset_parameters()`` -- ``nn.Parameter(torch.randn(...))`` in an ``__init__``, or a parent's
``__init__`` re-initialising a child -- and a module's ``reset_parameters()`` writing its
children's tensors (they are on meta when it runs). The first two shift every later draw.

[Note: init after every reset]
``init`` mirrors "build normally, then ``init(name, module)`` for every module with tensors of its
own, children first": all of construction's draws come before any of ``init``'s. So with ``init``
there are two passes. The first runs every ``reset_parameters()`` (one module at a time, results
dropped) only to note the random state before each; the second replays each module's reset from
its noted state, switches to where ``init``'s draws have got to, and calls ``init``. A tied tensor
is one tensor for ``init`` (as in the built model), so it stays whole until its last holder's
``init`` has run; during ``reset_parameters()``, holders after the first get a scratch copy, as
they had their own tensor while being built (a tie is made after both modules exist).

[Note: memory nobody wrote]
``torch.empty`` memory is never returned as a value. Fresh floating-point tensors are filled with
NaN, integer ones with their dtype's minimum; a value still holding one of them after
``reset_parameters()`` and ``init`` (booleans: never written, by the version counter) is an
error naming the tensor, its module and the fix.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._extract import aliases, extract
from .transforms._shard import PlacementFn, Placements, shard

Init = Callable[[str, nn.Module], None]


def materialize(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements | PlacementFn | None = None,
    *,
    init: Init | None = None,
) -> tuple[dict[str, DTensor], dict[str, torch.Tensor]]:
    """Initialise a module built under ``torch.device("meta")`` straight into shards.

    Returns ``(sharded, buffers)``: what ``fs.shard(fs.extract(m)[0], mesh, placements)`` and
    ``fs.extract(m)[1]`` give for the same module built normally (same keys and order, tied
    tensors once under their first name, buffers whole), on ``mesh``'s device. No rank holds the
    whole model: modules are initialised one at a time (see [Note: one module at a time]). With
    the same ``torch.manual_seed`` before, the values equal single-process construction when every
    random value is drawn by a module's ``reset_parameters()`` on its own tensors (see
    [Note: the order of initialisation]). ``module`` is left on meta, as it was.

    Args:
        module: built under ``torch.device("meta")``; every parameter and buffer on meta.
        mesh: as for :func:`~funcshard.shard`; tensors are made on its device type.
        placements: as for :func:`~funcshard.shard` (a callable is called once per parameter,
            with its meta tensor).
        init: ``init(name, submodule)``, called under ``torch.no_grad()`` for every submodule
            with parameters or buffers of its own, after its ``reset_parameters()``, with that
            submodule's own tensors full and real (children first; ``name`` as in
            ``named_modules()``, ``""`` for the root). It must write every tensor that
            ``reset_parameters()`` does not (in place, or by assigning a tensor of the same shape
            and dtype). Its random draws follow all of ``reset_parameters()``'s.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``init`` is not callable.
        ValueError: a tensor is not on meta; ``init`` assigned a tensor of another shape, dtype
            or device; a tensor that neither ``reset_parameters()`` nor ``init`` (fully) wrote;
            anything :func:`~funcshard.shard` raises for ``mesh`` / ``placements``.

    Warns:
        UserWarning: a tensor was written more often while the module was built than its
            ``reset_parameters()`` writes it (e.g. by a parent's ``__init__``), or a module's
            ``reset_parameters()`` / ``init`` wrote a submodule's tensors (lost): values then
            differ from single-process construction.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"materialize: module must be an nn.Module, got {type(module).__name__}.")
    if init is not None and not callable(init):
        raise TypeError(f"materialize: init must be a function (name, module), got {init!r}.")
    params, buffers = extract(module)  # meta tensors; records the module's ties
    steps = _steps(module, aliases(module))
    # placements are checked (and a callable called) once, up front, on the meta tensors
    placed = {k: v.placements for k, v in shard(params, mesh, placements).items()}
    done = {}
    for fqn, full in _values(steps, _device(mesh), init):
        done[fqn] = shard({fqn: full}, mesh, placed[fqn])[fqn] if fqn in params else full
        del full
    return {k: done[k] for k in params}, {k: done[k] for k in buffers}


class _Slot(NamedTuple):
    """One own parameter or buffer of a module."""

    kind: str  # "_parameters" or "_buffers"
    name: str  # its attribute name
    fqn: str
    canonical: str  # the fqn whose value it holds: itself, unless tied
    meta: torch.Tensor  # the module's meta tensor, put back afterwards


class _Step(NamedTuple):
    name: str
    module: nn.Module
    slots: tuple[_Slot, ...]


def _steps(root: nn.Module, alias: dict[str, str]) -> list[_Step]:
    """Modules with own tensors, children first (see [Note: the order of initialisation])."""
    steps = []
    for name, m in _children_first(root):
        slots = []
        for kind in ("_parameters", "_buffers"):
            for n, t in getattr(m, kind).items():
                if t is None:
                    continue
                fqn = _join(name, n)
                if not t.is_meta:
                    raise ValueError(
                        f"materialize: {fqn!r} is on {t.device}, not on the meta device. Build the "
                        'module under `with torch.device("meta"):`; a module that already holds '
                        "its values needs no materialize: fs.shard(fs.extract(module)[0], mesh)."
                    )
                slots.append(_Slot(kind, n, fqn, alias.get(fqn, fqn), t))
        if slots:
            steps.append(_Step(name, m, tuple(slots)))
    return steps


def _children_first(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each module once, under its ``named_modules()`` name, after its children."""
    seen: set[nn.Module] = set()

    def visit(prefix: str, m: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        seen.add(m)
        for n, child in m.named_children():
            if child not in seen:
                yield from visit(_join(prefix, n), child)
        yield prefix, m

    return list(visit("", root))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _values(
    steps: list[_Step], device: torch.device, init: Init | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical fqn, full value)`` for every value, once no later step touches it."""
    first, last = {}, {}
    for i, step in enumerate(steps):
        for s in step.slots:
            first.setdefault(s.canonical, (i, s.fqn))
            last[s.canonical] = i
    final = last if init is not None else {c: i for c, (i, _) in first.items()}
    starts = _reset_starts(steps, device) if init is not None else None
    cursor = _rng_state(device)  # with init: where init's draws have got to
    held: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # value, fresh, its version
    for i, step in enumerate(steps):
        if starts is not None:
            _set_rng_state(device, starts[i])
        fresh = {s.fqn: _fresh(s.meta, device) for s in step.slots}
        with _swapped(step, fresh), _lost_writes_warning(step):
            versions = {fqn: t._version for fqn, t in fresh.items()}
            _reset(step)
            for s in step.slots:
                if first[s.canonical] == (i, s.fqn):
                    _warn_extra_writes(step, s, fresh[s.fqn]._version - versions[s.fqn])
                    held[s.canonical] = (fresh[s.fqn], fresh[s.fqn], versions[s.fqn])
            if init is not None:
                _set_rng_state(device, cursor)
                for s in step.slots:  # the value itself, shared by every holder of a tie
                    getattr(step.module, s.kind)[s.name] = held[s.canonical][0]
                with torch.no_grad():
                    init(step.name, step.module)
                cursor = _rng_state(device)
                for s in step.slots:
                    held[s.canonical] = (_assigned(step, s), *held[s.canonical][1:])
        del fresh
        for c in dict.fromkeys(s.canonical for s in step.slots):
            if final[c] == i:
                value, poisoned, version = held.pop(c)
                _check_written(steps[first[c][0]], first[c][1], value, poisoned, version, init)
                yield c, value
                del value, poisoned
    if starts is not None:
        _set_rng_state(device, cursor)


def _reset_starts(steps: list[_Step], device: torch.device) -> list[list[torch.Tensor]]:
    """The random state before each step's ``reset_parameters()`` (the first pass of
    [Note: init after every reset]); leaves the state after the last one."""
    starts = []
    for step in steps:
        starts.append(_rng_state(device))
        with _swapped(step, {s.fqn: _fresh(s.meta, device) for s in step.slots}):
            _reset(step)
    return starts


def _reset(step: _Step) -> None:
    reset = getattr(step.module, "reset_parameters", None)
    if callable(reset):
        with torch.no_grad():
            reset()


@contextlib.contextmanager
def _swapped(step: _Step, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``step``'s own tensors replaced by ``tensors`` (by fqn); its meta tensors put back after."""
    try:
        for s in step.slots:
            getattr(step.module, s.kind)[s.name] = tensors[s.fqn]
        yield
    finally:
        for s in step.slots:
            getattr(step.module, s.kind)[s.name] = s.meta


def _fresh(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``meta`` on ``device``, poisoned (see [Note: memory nobody
    wrote]); a ``Parameter`` if ``meta`` is one."""
    t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if isinstance(meta, nn.Parameter):
        t = nn.Parameter(t, requires_grad=meta.requires_grad)
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)
    return t


def _assigned(step: _Step, s: _Slot) -> torch.Tensor:
    """The slot's tensor after ``init``, which may have assigned a new one."""
    t = getattr(step.module, s.kind).get(s.name)
    held = (s.meta.shape, s.meta.dtype)
    if not isinstance(t, torch.Tensor) or (t.shape, t.dtype) != held or t.is_meta:
        got = (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"materialize: init({step.name!r}, ...) replaced {s.fqn!r} by {got}; it must stay a "
            f"real tensor of shape {tuple(s.meta.shape)} and dtype {s.meta.dtype}. Write into it "
            "in place (nn.init.*_, .copy_) instead."
        )
    return t


def _check_written(step: _Step, fqn: str, value, poisoned, version: int, init: Init | None) -> None:
    """Raise if ``value`` is the fresh tensor and still (partly) holds its poison."""
    if value is not poisoned or value.numel() == 0:
        return
    if value.dtype.is_floating_point:
        unwritten = bool(value.detach().amax().isnan())
    elif value.dtype.is_complex:
        unwritten = bool(value.detach().isnan().any())
    elif value.dtype == torch.bool:
        unwritten = value._version == version
    else:
        unwritten = bool(value.detach().amin() == torch.iinfo(value.dtype).min)
    if not unwritten:
        return
    kind = type(step.module).__name__
    owner = f"{kind} {step.name!r}" if step.name else f"the root module ({kind})"
    if callable(getattr(step.module, "reset_parameters", None)):
        why = "its reset_parameters() left elements unwritten"
    else:
        why = "it has no reset_parameters()"
    why += " and init did not write them" if init is not None else " and no init was given"
    raise ValueError(
        f"materialize: {fqn!r} of {owner} was not (fully) initialised: {why}. Values made in "
        "__init__ (nn.Parameter(torch.randn(...)), a buffer computed from data) cannot be "
        f"recovered from the meta device: pass init=fn where fn(name, module) writes it when "
        f"name == {step.name!r}, or give {kind} a reset_parameters() that does."
    )


def _warn_extra_writes(step: _Step, s: _Slot, reset_writes: int) -> None:
    """Warn if the meta tensor was written more often while built than ``reset_parameters()``
    writes it: someone else initialised it (see [Note: the order of initialisation]). Without a
    ``reset_parameters()`` the value is ``init``'s to make, whatever ``__init__`` did."""
    extra = s.meta._version - reset_writes
    if extra > 0 and callable(getattr(step.module, "reset_parameters", None)):
        warnings.warn(
            f"funcshard.materialize: {s.fqn!r} was written {extra} more time(s) while the module "
            f"was built than {type(step.module).__name__}.reset_parameters() writes it (e.g. by a "
            "parent's __init__, nn.init.normal_(self.embed.weight)). That cannot be replayed from "
            "the meta device: this tensor, and random values drawn after it, differ from "
            "single-process init. Do that initialisation in init= instead.",
            stacklevel=4,
        )


@contextlib.contextmanager
def _lost_writes_warning(step: _Step) -> Iterator[None]:
    """Warn if the step's ``reset_parameters()`` / ``init`` wrote its submodules' (meta)
    tensors: those writes are lost (see [Note: the order of initialisation])."""
    own = {s.fqn for s in step.slots}
    named = itertools.chain(
        step.module.named_parameters(step.name), step.module.named_buffers(step.name)
    )
    others = [(fqn, t, t._version) for fqn, t in named if fqn not in own and t.is_meta]
    yield
    written = [fqn for fqn, t, v in others if t._version != v]
    if written:
        warnings.warn(
            f"funcshard.materialize: reset_parameters() or init of {step.name or '<root>'!r} "
            f"wrote {written}, which belong to its submodules and are on the meta device at that "
            "point: those writes are lost (the submodules' own reset_parameters()/init made "
            "their values), so they differ from single-process init. Initialise each tensor from "
            "the module that owns it.",
            stacklevel=5,
        )


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    """The default generators ``reset_parameters()`` may draw from: CPU's and ``device``'s."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


def _set_rng_state(device: torch.device, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(states[1], device)
