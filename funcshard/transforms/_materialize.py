"""``materialize``: a module built on the meta device -> initialised shards, one module at a time.

[Note: one module at a time]
No rank ever holds the whole model. Modules are visited one at a time; each gets fresh full
tensors for its *own* (non-recursive) parameters and buffers, swapped into the module in place of
its meta tensors, runs its ``reset_parameters()`` (then ``init``), and gives them back: parameters
are cut to this rank's chunk (by :func:`~funcshard.shard` itself), buffers are kept whole (as
``fs.extract`` returns them). The meta tensors are put back, so the module is left as it was: a
recipe for ``fs.schedule``, ties intact. Peak memory: the shards so far, plus one module's own
full tensors (plus, rarely, those a later ``reset_parameters()`` / ``init`` still writes: see
[Note: writes into submodules] in ``_materialize_steps.py``). Every rank runs the same random
stream, so the ranks agree without communication.

[Note: the order of initialisation]
Modules are visited children first, as ``Module.apply`` visits them. Single-process construction
draws a module's random values when its ``__init__`` calls ``reset_parameters()``, which
``torch.nn`` layers do on their last line, after any children were built; so the order in which
``__init__``s *finish* is children before parents, in registration order. (For leaves this is
also ``named_modules()`` order; the two differ only for a module with tensors of its own *and*
children, such as ``nn.MultiheadAttention``'s ``in_proj_weight`` drawn after ``out_proj``.)
What cannot be replayed from a meta module: random values drawn outside any
``reset_parameters()`` -- ``nn.Parameter(torch.randn(...))`` in an ``__init__``, or a parent's
``__init__`` re-initialising a child (unless built under ``fs.on_meta()``, see [Note: recording a
constructor] in ``_construction.py``). Both shift every later draw.

[Note: init after every reset]
``init`` mirrors "build normally, then ``init`` on every module, children first": all of
construction's draws come before any of ``init``'s. So with ``init`` there are two passes. The
first runs every ``reset_parameters()`` (one module at a time, results dropped) only to note the
random state before each; the second replays each module's reset from its noted state, switches
to where ``init``'s draws have got to, and calls ``init``. (The first pass also replays what
``fs.on_meta`` recorded, whose draws follow the module's reset: otherwise they would reuse the
next module's numbers.) A tied tensor is one tensor for
``init`` (as in the built model), so it stays whole until its last holder's ``init`` has run;
during ``reset_parameters()``, holders after the first get a scratch copy, as they had their own
tensor while being built (a tie is made after both modules exist).

[Note: memory nobody wrote]
``torch.empty`` memory is never returned as a value. Fresh floating-point tensors are filled with
NaN, integer ones with their dtype's minimum; a value still holding one of them after
``reset_parameters()`` and ``init`` (booleans: never written, by the version counter) is an
error naming the tensor, its module and the fix.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

from .._trees._construction import Construction, recorded, replay
from .._trees._extract import aliases, extract
from .._trees._materialize_steps import (
    _call,
    _fresh,
    _Plan,
    _plan,
    _reset,
    _Slot,
    _Step,
    _steps,
    _swapped,
)
from ._shard import PlacementFn, Placements, shard

Init = Callable[[str, nn.Module], None] | Callable[[nn.Module], None]


def materialize(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements | PlacementFn | None = None,
    *,
    init: Init | None = None,
    construction: Construction | None = None,
) -> tuple[dict[str, DTensor], dict[str, torch.Tensor]]:
    """Initialise a module built under ``torch.device("meta")`` straight into shards.

    Returns ``(sharded, buffers)``: what ``fs.shard(fs.extract(m)[0], mesh, placements)`` and
    ``fs.extract(m)[1]`` give for the same module built normally (same keys and order, tied
    tensors once under their first name, buffers whole), on ``mesh``'s device. No rank holds the
    whole model: modules are initialised one at a time (see [Note: one module at a time]). With
    the same ``torch.manual_seed`` before, the values equal single-process construction when every
    random value is drawn by a module's ``reset_parameters()`` (see [Note: the order of
    initialisation]). ``module`` is left on meta, as it was.

    Args:
        module: built under ``torch.device("meta")`` (or :func:`~funcshard.on_meta`); every
            parameter and buffer on meta.
        mesh: as for :func:`~funcshard.shard`; tensors are made on its device type.
        placements: as for :func:`~funcshard.shard` (a callable is called once per parameter,
            with its meta tensor).
        init: ``init(name, submodule)`` or ``init(submodule)`` (``Module.apply``'s form, e.g. a
            Hugging Face model's ``_init_weights``: a function of one parameter), called under
            ``torch.no_grad()`` for every submodule, children first, after the
            ``reset_parameters()`` of every module below it, with the tensors it writes (its own
            and its submodules') full and real (``name`` as in ``named_modules()``, ``""`` for the
            root). It must write every tensor that ``reset_parameters()`` does not (in place, or
            by assigning a tensor of the same shape and dtype). It also runs once on the meta
            module first, to find what it writes (see [Note: writes into submodules]).
        construction: from :func:`~funcshard.on_meta`, if ``module`` was built under it: writes
            its constructor made outside ``reset_parameters()`` are replayed.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; ``init`` is not a function of
            ``(name, module)`` or ``(module)``; ``construction`` is not a ``Construction``.
        ValueError: a tensor is not on meta; ``init`` assigned a tensor of another shape, dtype
            or device; a tensor that neither ``reset_parameters()`` nor ``init`` (fully) wrote;
            anything :func:`~funcshard.shard` raises for ``mesh`` / ``placements``.

    Warns:
        UserWarning: once, naming the modules, when tensors were written while the module was
            built by something other than their ``reset_parameters()`` (a parent's ``__init__``)
            and neither ``construction`` nor ``init`` re-does it; or when a ``reset_parameters()``
            / ``init`` wrote meta tensors it had not written in the dry run (lost); when
            ``init`` is not given for a module with ``_init_weights`` (Hugging Face).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"materialize: module must be an nn.Module, got {type(module).__name__}.")
    init = _named(init)
    if construction is not None and not isinstance(construction, Construction):
        raise TypeError(
            "materialize: construction must be what `with fs.on_meta() as construction:` gave, "
            f"got {type(construction).__name__}."
        )
    if init is None and callable(getattr(module, "_init_weights", None)):
        warnings.warn(
            f"materialize: {type(module).__name__} has _init_weights (a Hugging Face model), "
            "whose initialisation does not run on meta tensors; its modules get their own "
            "reset_parameters() only. Pass init=model._init_weights to reproduce the model's "
            "initialisation.",
            stacklevel=2,
        )
    params, buffers = extract(module)  # meta tensors; records the module's ties
    steps = _steps(module, aliases(module), every=init is not None)
    # placements are checked (and a callable called) once, up front, on the meta tensors
    placements = _once(placements)
    shard(params, mesh, placements)
    plan = _plan(steps, init)
    done, unreplayed = {}, {}
    for fqn, full in _values(plan, _device(mesh), init, construction, unreplayed):
        if fqn in params:
            full = shard({fqn: _model_parallel(full, params[fqn])}, mesh, placements)[fqn]
        done[fqn] = full
        del full
    _warn_unreplayed([u for c, u in unreplayed.items() if c not in plan.rewritten], construction)
    return {k: done[k] for k in params}, {k: done[k] for k in buffers}


def _once(placements):
    """``placements``, a function of ``(path, tensor)`` answering each path as it did the first
    time (on the meta tensor); other forms as they are."""
    if not callable(placements) or isinstance(placements, Placement):
        return placements
    first: dict = {}
    return lambda path, t: (
        first[path] if path in first else first.setdefault(path, placements(path, t))
    )


def _model_parallel(full: torch.Tensor, meta) -> torch.Tensor:
    """``full`` placed as the module's meta parameter: for a module parallelized on meta
    (``parallelize_module`` before ``materialize``), this rank's part of the full value as a
    DTensor on the TP (or EP) mesh -- taken locally, every rank holding the same value -- which
    ``shard`` then splits over the data-parallel mesh (the 2-D layout, docs/parallelism.md)."""
    if not isinstance(meta, DTensor):
        return full
    return distribute_tensor(full, meta.device_mesh, meta.placements, src_data_rank=None)


def _named(init) -> Callable[[str, nn.Module], None] | None:
    """``init`` as a function of ``(name, module)``; ``init(module)`` is called without the name."""
    if init is None:
        return None
    try:
        sig = inspect.signature(init)
        one = len(sig.parameters) == 1 and next(iter(sig.parameters.values())).kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
    except (TypeError, ValueError):  # not callable, or a builtin without a signature
        one = False
    if not callable(init):
        raise TypeError(
            f"materialize: init must be a function (name, module) or (module), got {init!r}."
        )
    return (lambda name, m: init(m)) if one else init


def _values(
    plan: _Plan,
    device: torch.device,
    init,
    construction: Construction | None,
    unreplayed: dict[str, tuple[_Step, _Slot]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(canonical fqn, full value)`` for every value, once no later step touches it; notes in
    ``unreplayed`` the tensors whose construction wrote them beyond ``reset_parameters()``,
    could not be replayed, and that their own module's ``init`` does not write."""
    steps, first, final = plan.steps, plan.first, plan.final
    starts = _reset_starts(plan, device, construction) if init is not None else None
    cursor = _rng_state(device)  # with init: where init's draws have got to
    held: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # value, fresh, its version
    replayed = {s.fqn for st in steps for s in st.slots if s.canonical in plan.deferred}
    for i, step in enumerate(steps):
        if starts is not None and starts[i] is not None:
            _set_rng_state(device, starts[i])
        fresh = {s.fqn: _fresh(s.meta, device) for s in step.slots}
        fresh.update({s.fqn: held[s.canonical][0] for s in step.foreign})
        exposed = [*step.slots, *step.foreign]
        with _swapped(exposed, fresh), _lost_writes_warning(step, replayed):
            versions, bad = _construct(i, step, fresh, first, construction)
            unreplayed.update({s.canonical: (step, s) for s in bad})
            _take_assigned(step, step.foreign, held)
            for s in step.slots:
                if first[s.canonical] == (i, s.fqn):
                    held[s.canonical] = (fresh[s.fqn], fresh[s.fqn], versions[s.fqn])
            if init is not None:
                _set_rng_state(device, cursor)
                for s in exposed:  # the value itself, shared by every holder of a tie
                    getattr(s.module, s.kind)[s.name] = held[s.canonical][0]
                for c in _init(step, init, exposed, held):
                    unreplayed.pop(c, None)  # init wrote it: what construction did is moot
            for c in dict.fromkeys(s.canonical for s in exposed):
                if final[c] == i and c in plan.deferred:  # see [Note: writes into submodules]
                    replay(plan.deferred[c], held[c][0])
            cursor = _rng_state(device)
        del fresh
        for c in dict.fromkeys(s.canonical for s in exposed):
            if final[c] == i:
                value, poisoned, version = held.pop(c)
                check = (value, poisoned, version, init, construction)
                _check_written(steps[first[c][0]], first[c][1], *check)
                yield c, value
                del value, poisoned
    if starts is not None:
        _set_rng_state(device, cursor)


def _init(step: _Step, init, exposed: list[_Slot], held: dict) -> set[str]:
    """Call ``init`` on ``step``'s module; the canonical fqns of the held values it wrote."""
    before = {c: (held[c][0], held[c][0]._version) for c in held}
    _call(init, step)
    _take_assigned(step, exposed, held)
    return {c for c, (t, v) in before.items() if held[c][0] is not t or t._version != v}


def _take_assigned(step: _Step, slots, held) -> None:
    """Pick up the tensors ``reset_parameters()`` / ``init`` assigned to ``slots``."""
    for s in slots:
        if s.canonical in held:
            held[s.canonical] = (_assigned(step, s), *held[s.canonical][1:])


def _replay_construction(
    step: _Step, s: _Slot, value: torch.Tensor, reset_writes: int, construction
) -> bool:
    """Replay what construction wrote into ``s`` after its ``reset_parameters()`` (the recorded
    writes past the ones reset makes; all of them and the factory call if reset makes none: see
    [Note: recording a constructor]); False if it did and that cannot be replayed."""
    made, writes = recorded(construction, s.meta)
    if len(writes) > reset_writes or (reset_writes == 0 and made):
        ops = [*made, *writes] if reset_writes == 0 else writes[reset_writes:]
        if None in ops:
            return False
        replay(ops, value)
        return True
    has_reset = callable(getattr(step.module, "reset_parameters", None))
    return not (has_reset and s.meta._version > reset_writes)


def _construct(i: int, step: _Step, fresh: dict, first: dict, construction):
    """``step``'s ``reset_parameters()`` on the ``fresh`` tensors swapped in, then the replay of
    what construction did beyond it; returns the versions before, and the slots whose
    construction could not be replayed."""
    versions = {s.fqn: fresh[s.fqn]._version for s in step.slots}
    _reset(step)
    bad = []
    for s in step.slots:
        if first[s.canonical] == (i, s.fqn):
            writes = fresh[s.fqn]._version - versions[s.fqn]
            if not _replay_construction(step, s, fresh[s.fqn], writes, construction):
                bad.append(s)
    return versions, bad


def _reset_starts(plan: _Plan, device: torch.device, construction) -> list:
    """The random state before each step's ``reset_parameters()`` and construction replay
    (``None`` for a step without tensors of its own: the first pass of [Note: init after every
    reset]); leaves the state after the last one."""
    starts = []
    for i, step in enumerate(plan.steps):
        starts.append(_rng_state(device) if step.slots else None)
        exposed = [*step.slots, *step.foreign]
        fresh = {s.fqn: _fresh(s.meta, device) for s in exposed}
        with _swapped(exposed, fresh):
            _construct(i, step, fresh, plan.first, construction)
        del fresh
    return starts


def _assigned(step: _Step, s: _Slot) -> torch.Tensor:
    """The slot's tensor after ``init``, which may have assigned a new one."""
    t = getattr(s.module, s.kind).get(s.name)
    held = (s.meta.shape, s.meta.dtype)
    if not isinstance(t, torch.Tensor) or (t.shape, t.dtype) != held or t.is_meta:
        got = (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"materialize: init({step.name!r}, ...) replaced {s.fqn!r} by {got}; it must stay a "
            f"real tensor of shape {tuple(s.meta.shape)} and dtype {s.meta.dtype}. Write into it "
            "in place (nn.init.*_, .copy_) instead."
        )
    return t


def _check_written(
    step: _Step, fqn: str, value, poisoned, version: int, init, construction
) -> None:
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
    made = "" if construction else (
        " Values made from constants in __init__ (torch.tensor(2.5), torch.ones(d) * c, a table "
        "from torch.arange) are recorded if the module is built under `with fs.on_meta() as "
        "construction:` (pass construction=)."
    )  # fmt: skip
    raise ValueError(
        f"materialize: {fqn!r} of {owner} was not (fully) initialised: {why}.{made} Random "
        "values made in __init__ (nn.Parameter(torch.randn(...))) and values computed from "
        "them or from data cannot be recovered from the meta device: pass init=fn where "
        f"fn(name, module) writes it when name == {step.name!r}, or give {kind} a "
        "reset_parameters() that does."
    )


def _warn_unreplayed(unreplayed: list[tuple[_Step, _Slot]], construction) -> None:
    """One warning naming the modules whose tensors construction wrote beyond their
    ``reset_parameters()`` and that nothing replays (see [Note: the order of initialisation])."""
    if not unreplayed:
        return
    names = list(dict.fromkeys(step.name or "<root>" for step, _ in unreplayed))
    shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
    if construction is None:
        why = "the meta device keeps no record of what, so they may differ from the normal build"
        fix = "build it under `with fs.on_meta() as construction:` and pass construction="
    else:
        why = "it wrote part of a tensor, or from another one: that is not replayed, so they differ"
        fix = "do that in init="
    warnings.warn(
        f"funcshard.materialize: the tensors of {shown} were initialised while built by "
        f"something other than their reset_parameters() (a parent's __init__?); {why}. To fix: "
        f"{fix}.",
        stacklevel=3,
    )


@contextlib.contextmanager
def _lost_writes_warning(step: _Step, replayed: set[str]) -> Iterator[None]:
    """Warn if the step's ``reset_parameters()`` / ``init`` wrote meta tensors of its submodules
    that the dry run did not see it write: those writes are lost (see [Note: writes into
    submodules])."""
    own = {s.fqn for s in (*step.slots, *step.foreign)} | replayed
    named = itertools.chain(
        step.module.named_parameters(step.name), step.module.named_buffers(step.name)
    )
    others = [(fqn, t, t._version) for fqn, t in named if fqn not in own and t.is_meta]
    yield
    written = [fqn for fqn, t, v in others if t._version != v]
    if written:
        warnings.warn(
            f"funcshard.materialize: reset_parameters() or init of {step.name or '<root>'!r} "
            f"wrote {written}, which it had not written when run on the meta device first: "
            "those writes are lost, so they differ from single-process init. Make it write the "
            "same tensors whatever their values.",
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
