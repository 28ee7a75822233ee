"""The steps of ``materialize``: which module runs when, with which tensors real.

[Note: writes into submodules]
Hugging Face's ``_init_weights`` runs on every module and sets ``module.c_proj.weight`` from
``GPT2Attention``, which owns no tensor itself; torchtitan's ``init_weights`` writes its layers'
weights by name from the root. Before the real pass, the ``reset_parameters()`` and ``init`` of
every module with submodules' tensors run once on the meta module, with fresh meta tensors
swapped in (no memory, no random draws, the module's own version counters untouched), under the
recorder of ``on_meta`` (see [Note: recording a constructor] in ``_construction.py``): a bumped
version counter, a record or an assigned tensor says which tensors each call writes, and the
record says how; the recorder also notes the tensors a call reads. A submodule's tensor that its
ancestors write only by replayable ops (``normal_(std=...)``, ``trunc_normal_``, ``fill_``: whole
tensor, no other meta tensor) and do not read gets those ops replayed at its own module's turn,
right after its own ``init``: one module at a time still, and equal in distribution to the
normal build followed by ``model.apply(init)`` (the ancestors' draws come at another point of the
stream). Otherwise (``w.copy_(other)``, a write to part of it, an assignment, a read, or an
ancestor that runs before a later holder of a tie) the tensor stays full until the last call
that touches it and is swapped into its module for that call: the exact values of the normal
build, at the cost of memory. A module's writes into its own tensors need no dry run: the real
pass sees them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from ._construction import _Op, _Recorder
from ._subclass import is_subclass


class _Slot(NamedTuple):
    """One own parameter or buffer of a module."""

    module: nn.Module
    kind: str  # "_parameters" or "_buffers"
    name: str  # its attribute name
    fqn: str
    canonical: str  # the fqn whose value it holds: itself, unless tied
    meta: torch.Tensor  # the module's meta tensor, put back afterwards


class _Step(NamedTuple):
    name: str
    module: nn.Module
    slots: tuple[_Slot, ...]  # its own tensors
    foreign: tuple[_Slot, ...] = ()  # submodules' tensors its reset_parameters() / init write


class _Plan(NamedTuple):
    steps: list[_Step]
    first: dict[str, tuple[int, str]]  # canonical -> (step, fqn) of its first holder
    final: dict[str, int]  # canonical -> the last step that needs it full
    deferred: dict[str, list[_Op]]  # canonical -> ancestors' writes, replayed at ``final``
    rewritten: set[str]  # canonicals that an ancestor's init or reset_parameters() writes


def _steps(root: nn.Module, alias: dict[str, str], every: bool) -> list[_Step]:
    """Modules with own tensors (``every``: all modules), children first (see [Note: the order
    of initialisation] in ``_materialize.py``)."""
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
                slots.append(_Slot(m, kind, n, fqn, alias.get(fqn, fqn), t))
        if slots or every:
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


def _plan(steps: list[_Step], init) -> _Plan:
    """Run every ``reset_parameters()`` and ``init`` once on fresh meta tensors and decide, for
    each tensor a submodule's ancestor writes, replay or hold (see [Note: writes into
    submodules])."""
    writers, rewritten = _dry_run(steps, init)
    first, final = {}, {}
    for i, step in enumerate(steps):
        for s in step.slots:
            first.setdefault(s.canonical, (i, s.fqn))
            if init is not None or first[s.canonical][0] == i:
                final[s.canonical] = i
    deferred, held_by = {}, {}
    for c, writes in writers.items():
        if all(ops is not None for _, ops in writes) and writes[0][0] > final[c]:
            deferred[c] = [op for _, ops in writes for op in ops]
        else:
            for i, _ in writes:
                held_by.setdefault(i, set()).add(c)
                final[c] = max(final[c], i)
    below = _below(steps)
    steps = [
        st._replace(foreign=tuple(s for s in below[i] if s.canonical in held_by.get(i, ())))
        for i, st in enumerate(steps)
    ]
    return _Plan(steps, first, final, deferred, rewritten)


def _below(steps: list[_Step]) -> list[list[_Slot]]:
    """Each step's submodules' slots (its own excluded)."""
    slots = {st.module: st.slots for st in steps}
    return [
        [s for m in st.module.modules() if m is not st.module for s in slots.get(m, ())]
        for st in steps
    ]


def _dry_run(steps: list[_Step], init):
    """``writers``: canonical -> [(step, its recorded ops, or None if not replayable or read)]
    for the submodules' tensors each step writes or reads; ``rewritten``: the canonicals that an
    ancestor's ``init`` or ``reset_parameters()`` writes. Steps without submodules' tensors are
    skipped (most modules: the dry run costs one pass over the containers)."""
    every = [s for st in steps for s in st.slots]
    scratch: dict[str, torch.Tensor] = {}
    for s in every:
        scratch.setdefault(s.canonical, _fresh(s.meta, torch.device("meta"), poison=False))
    writers: dict[str, list] = {}
    rewritten: set[str] = set()
    with _swapped(every, {s.fqn: scratch[s.canonical] for s in every}):
        for i, (st, below) in enumerate(zip(steps, _below(steps), strict=True)):
            if not below:  # writes into its own tensors are seen in the real pass
                continue
            own = {s.canonical for s in st.slots}
            calls = [lambda st=st: _reset(st)] if st.slots else []
            if init is not None:
                calls.append(lambda st=st: _call(init, st))
            for call in calls:
                written, read = _writes_of(call, below)
                rewritten |= set(written)
                touched = {**written, **dict.fromkeys(read)}  # a read needs the value real
                for c, ops in touched.items():
                    if c not in own:
                        writers.setdefault(c, []).append((i, ops))
    return writers, rewritten


def _writes_of(call: Callable[[], None], slots: list[_Slot]):
    """``(written, read)``: canonical -> the ops ``call`` applied to it, for the ``slots`` it
    writes in place or assigns (assigned tensors are put back; ``None``: cannot be replayed), and
    the canonicals whose values it reads (they must be real when ``call`` runs)."""
    before = [(s, getattr(s.module, s.kind)[s.name]) for s in slots]
    versions = [t._version for _, t in before]
    recorder = _Recorder({})
    try:
        with recorder:
            call()
    except Exception as e:
        e.add_note(
            "funcshard.materialize calls init on every module (children first, as Module.apply "
            "does), and runs it and every reset_parameters() once on the meta module first, to "
            "find which tensors each writes: it must run there too."
        )
        raise
    written, read = {}, set()
    for (s, t), v in zip(before, versions, strict=True):
        assigned = getattr(s.module, s.kind).get(s.name) is not t
        getattr(s.module, s.kind)[s.name] = t
        rec = recorder.records.get(t.untyped_storage())
        writes = list(rec.writes) if rec is not None else []
        if assigned or t._version != v or writes:
            replayable = writes and None not in writes and not assigned
            written[s.canonical] = writes if replayable else None
        if t.untyped_storage() in recorder.read:
            read.add(s.canonical)
    return written, read


def _call(init, step: _Step) -> None:
    with torch.no_grad():
        init(step.name, step.module)


def _reset(step: _Step) -> None:
    reset = getattr(step.module, "reset_parameters", None)
    if callable(reset) and step.slots:
        with torch.no_grad():
            reset()


@contextlib.contextmanager
def _swapped(slots, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``slots``' tensors replaced by ``tensors`` (by fqn); their meta tensors put back after."""
    try:
        for s in slots:
            getattr(s.module, s.kind)[s.name] = tensors[s.fqn]
        yield
    finally:
        for s in slots:
            getattr(s.module, s.kind)[s.name] = s.meta


def _fresh(meta: torch.Tensor, device: torch.device, poison: bool = True) -> torch.Tensor:
    """An uninitialised tensor like ``meta`` on ``device``, poisoned (see [Note: memory nobody
    wrote] in ``_materialize.py``); a ``Parameter`` if ``meta`` is one, and of ``meta``'s
    tensor subclass if it is one (float8 training's weight: ``empty_like`` keeps it)."""
    if is_subclass(meta):
        t = torch.empty_like(meta, device=device)
    else:
        t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    if isinstance(meta, nn.Parameter):
        t = nn.Parameter(t, requires_grad=meta.requires_grad)
    if not poison:
        return t
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)
    return t
