"""Ranks that step differently: the optimizer's updates join the ranks' per-call check.

[Note: the optimizer rides the next check]
The per-call check (see [Note: one status per call] in ``_consensus``) compares what the ranks
pass to ``unshard`` / ``reduce`` / a scheduled ``apply``, but the optimizer step between two
such calls runs on each rank alone: a learning rate that differs on one rank, a transformation
in one rank's chain only, or a step skipped on one rank (after a non-finite loss seen there)
would split the replicas silently, or leave one rank alone in a collective of the optimizer
(``clip_by_global_norm``'s all-reduce) until the timeout. So every top-level update of a
:class:`~funcshard.optim.GradientTransformation` on sharded (DTensor) gradients leaves a
*record* on its rank -- a description of the transformation (its chain and hyperparameters, the
values its functions close over) and the step counts of its state -- and the next exchange
carries every record left since the previous one, in the status that exchange publishes anyway:

- an optimizer that does not communicate (``adamw``, ``sgd``) costs no exchange of its own:
  its records ride the next call's status (the next step's ``value_and_grad``), so a
  difference is caught there, before that call's first collective;
- an optimizer that communicates (``clip_by_global_norm``, ``apply_if_finite``, Muon's
  exchange) checks its record right before its first collective, through the same exchange,
  so a rank whose chain has no such collective, or that skipped its step, meets it with its
  next call's check and both raise, instead of one waiting in the all-reduce until the
  timeout. That is one more exchange per step (BENCHMARKS.md section 11), and it cannot ride
  an earlier one: a chain announced at the previous check does not say that every rank will
  take this step;
- a rank that skipped its step (or took one more) publishes fewer (or more) records, or a
  step count that differs: an error on every rank at the next check, naming the ranks' steps.

Not detected: a rank that skips a whole iteration (its ``value_and_grad`` call and its step)
keeps every count equal to the others', and its calls pair with their next ones; nothing that
funcshard sees differs (only the batches do).

An error raised by one rank's update is announced to the others the same way (see ``failing``
in ``_consensus``). Records are kept per process (the exchange is per process too), at most
:data:`_KEPT` of them between two checks, and only while a process group of more than one rank
is initialised. Not under ``torch.compile`` (a compiled step runs the update as part of its
graph), nor while ``fs.cuda_graph`` captures a step: its warm-up steps leave records, which the
capture's own check carries; a replay runs no check (the step counts a record reads are host
tensors, and a graph cannot read the host). Counts kept on the device are not read (no sync).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from .._runtime._compile import compiling
from .._runtime._mode import capturing

_KEPT = 64  # records kept between two checks (the oldest are counted, not kept)
_PENDING: list[str] = []  # this process's records since its last check
_DROPPED = [0]  # records dropped from _PENDING since the last check
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("funcshard_update", default=False)
_DESCRIBED: dict[int, tuple[Callable, str]] = {}  # id(update) -> (update, its description)
_ENTRY = "<optimizer update"  # the prefix of the described entries (see taken)


def recorded_here(grads: Any) -> bool:
    """Whether an update on ``grads`` called here leaves a record: a top-level one (not from
    another transformation's update) of a multi-rank run on sharded gradients, neither compiled
    nor captured (a captured step checks once, at its capture: see [Note: capture is a mode])."""
    return not (compiling() or capturing() or _INSIDE.get()) and _shared(grads)


@contextlib.contextmanager
def recording(update: Callable, state: Any) -> Iterator[None]:
    """Leave the record of ``update`` at ``state``'s step counts; the body is its update, inside
    which nested transformations' updates leave none."""
    token = _INSIDE.set(True)
    try:
        _record(f"{describe(update)} at step {_steps(state)}")
        yield
    finally:
        _INSIDE.reset(token)


def pending() -> bool:
    """Whether this rank holds records not checked yet (never while compiled or captured)."""
    return bool(_PENDING) and not compiling() and not capturing()


def taken() -> tuple[str, list[tuple[str, str]]]:
    """This rank's records since its last check, consumed: their digest for the status
    (``""``: none), and their entries for the description of a difference."""
    if not _PENDING and not _DROPPED[0]:
        return "", []
    records, dropped = list(_PENDING), _DROPPED[0]
    _PENDING.clear()
    _DROPPED[0] = 0
    out = [(f"{_ENTRY} {i + 1 + dropped}>", r) for i, r in enumerate(records)]
    out.append((f"{_ENTRY}s>", str(len(records) + dropped)))
    digest = hashlib.blake2b(repr(out).encode(), digest_size=8).hexdigest()
    return digest, out


def differences(everyone: list[list[tuple[str, str]]]) -> str | None:
    """What differs in the ranks' optimizer records (``everyone``: each rank's described
    entries), or ``None`` if they are the same."""
    mine = [[(p, v) for p, v in entries if p.startswith(_ENTRY)] for entries in everyone]
    if all(m == mine[0] for m in mine):
        return None
    counts = [int(dict(m).get(f"{_ENTRY}s>", "0")) for m in mine]
    records = [[v for p, v in m if not p.endswith("s>")] for m in mine]
    if len(set(counts)) > 1:
        seen = by_rank(counts)
        last = by_rank([_short(rs[-1]) if rs else "none" for rs in records])
        return (
            f"the ranks made different numbers of optimizer updates since the last check ({seen}; "
            f"the last ones: {last}): a rank skipped an optimizer step (or its value_and_grad "
            "call), or took one more. Every rank must take every step: decide to skip a step "
            "the same way on every rank (fs.optim.apply_if_finite decides it for all ranks)."
        )
    at = next(i for i in range(max(map(len, records))) if len({_at(rs, i) for rs in records}) > 1)
    texts = [_at(rs, at) for rs in records]
    steps = [t.rsplit(" at step ", 1) for t in texts]
    if len({s[0] for s in steps}) == 1:
        seen = by_rank([f"at optimizer step {s[1]}" for s in steps]).replace(":", "")
        return (
            f"the ranks' optimizer states are at different steps ({seen}): a rank skipped an "
            "optimizer step (or its value_and_grad call), or took one more, or loaded another "
            "checkpoint. Every rank must take every step: decide to skip a step the same way on "
            "every rank (fs.optim.apply_if_finite decides it for all ranks)."
        )
    return (
        f"the ranks run different optimizers: {_first_difference([s[0] for s in steps])}. "
        "Build the optimizer the same way on every rank (the same chain, learning rate, "
        "schedule and hyperparameters; no rank-dependent configuration)."
    )


def _short(record: str) -> str:
    text, _, step = record.rpartition(" at step ")
    return (text if len(text) <= 80 else text[:77] + "...") + f" at step {step}"


def _at(records: list[str], i: int) -> str:
    return records[i] if i < len(records) else "none"


def _first_difference(texts: list[str]) -> str:
    """Each rank's text around the first character where the texts differ, ranks with the same
    text together."""
    n = 0
    while all(n < len(t) for t in texts) and len({t[n] for t in texts}) == 1:
        n += 1
    start = texts[0].rfind("(", 0, n)  # from the name of the call the difference is in
    while start > 0 and (texts[0][start - 1].isidentifier() or texts[0][start - 1] == "."):
        start -= 1
    start = max(start, n - 60, 0)
    end = n + 100
    cut = lambda t: ("..." if start else "") + t[start:end] + ("..." if len(t) > end else "")
    return by_rank([cut(t) for t in texts])


def by_rank(values: list) -> str:
    """``"ranks 0-2: a; rank 3: b"``: the ranks with each value (in order of first rank)."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())


def _ranks(ranks: list[int]) -> str:
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _record(text: str) -> None:
    if len(_PENDING) >= _KEPT:
        _PENDING.pop(0)
        _DROPPED[0] += 1
    _PENDING.append(text)


def _shared(grads: Any) -> bool:
    """Whether the update is one of a multi-rank run: sharded gradients, more than one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    if isinstance(grads, dict) and any(isinstance(x, DTensor) for x in grads.values()):
        return True  # the flat {fqn: DTensor} tree of fs.shard: no flatten per step
    return any(isinstance(x, DTensor) for x in optree.tree_leaves(grads))


def _steps(state: Any) -> str:
    """The step counts of ``state``: the 0-dim integer CPU tensors among the fields of its
    NamedTuples, tuples (a chain's) and dicts of states (a partition's), in order; not the
    parameter trees inside (moments, per-leaf steps), whose walk would cost a visit per
    parameter."""
    found: list[str] = []
    todo = [state]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple):
            todo.extend(reversed(x))
        elif isinstance(x, dict) and any(isinstance(v, tuple) for v in x.values()):
            todo.extend(reversed(list(x.values())))  # states by label (partition's)
        elif (
            isinstance(x, torch.Tensor)
            and not isinstance(x, DTensor)
            and x.ndim == 0
            and x.device.type == "cpu"
            and not x.is_floating_point()
            and x.dtype != torch.bool
            and not is_fake(x)  # fs.explain's step: no values
        ):
            found.append(str(int(x)))
    return "/".join(found) if found else "?"


def describe(update: Callable) -> str:
    """A text of ``update``'s transformation that is the same on ranks that built it the same
    way: its function's name and, recursively, the values it closes over (numbers, strings,
    tensors' values, dataclasses, nested transformations; other objects by type)."""
    found = _DESCRIBED.get(id(update))
    if found is not None and found[0] is update:
        return found[1]
    text, fixed = _describe(update, 0)
    if fixed:  # nothing mutable inside: the same text at every step
        if len(_DESCRIBED) > 1024:
            _DESCRIBED.clear()
        _DESCRIBED[id(update)] = (update, text)
    return text


def _describe(x: Any, depth: int) -> tuple[str, bool]:
    if depth > 8:
        return "...", True
    if x is None or isinstance(x, bool | int | float | complex | str | bytes | torch.dtype):
        return repr(x), True
    if hasattr(x, "funcshard_update"):  # a recorded update: describe what it runs
        return _describe(x.funcshard_update, depth)
    if isinstance(x, tuple) and hasattr(x, "_fields") and hasattr(x, "update"):
        return _describe(x.update, depth)  # a GradientTransformation (or alike)
    if isinstance(x, tuple) and x and all(_named(v) for v in x):  # (name, value) options
        parts = [(v[0], _describe(v[1], depth + 1)) for v in x[:256]]
        text = ", ".join(f"{k}={t}" for k, (t, _) in parts)
        return f"({text})", all(f for _, (_, f) in parts)
    if isinstance(x, tuple | list):
        parts = [_describe(v, depth + 1) for v in x[:256]]
        fixed = isinstance(x, tuple) and all(f for _, f in parts)
        return "(" + ", ".join(t for t, _ in parts) + ")", fixed
    if isinstance(x, dict):
        parts = [(repr(k), _describe(v, depth + 1)) for k, v in list(x.items())[:256]]
        fixed = all(f for _, (_, f) in parts)  # a dict in a closure: built once, not changed
        return "{" + ", ".join(f"{k}: {t}" for k, (t, _) in parts) + "}", fixed
    if isinstance(x, torch.Tensor):
        if x.numel() <= 16 and x.device.type == "cpu" and not isinstance(x, DTensor):
            return f"tensor({x.tolist()})", False
        return f"tensor({list(x.shape)}, {x.dtype})", False
    if isinstance(x, functools.partial):
        keywords = {k: v for k, v in x.keywords.items() if k != "inplace"}  # the donated form
        parts = [_describe(a, depth + 1) for a in x.args]
        parts += [(f"{k}={t}", f) for k, (t, f) in
                  ((k, _describe(v, depth + 1)) for k, v in keywords.items())]  # fmt: skip
        name, fixed = _describe(x.func, depth + 1)
        fixed = fixed and all(f for _, f in parts)
        if name.startswith("_") and len(parts) == 1:  # a private kernel of one record: the record
            return parts[0][0], fixed
        return f"{name}(" + ", ".join(t for t, _ in parts) + ")", fixed
    if isinstance(x, types.FunctionType):
        wrapped = getattr(x, "__wrapped__", None)  # a decorated function: what it runs
        return _describe(wrapped, depth) if callable(wrapped) else _function(x, depth)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = [(f.name, _describe(getattr(x, f.name), depth + 1)) for f in dataclasses.fields(x)]
        frozen = type(x).__dataclass_params__.frozen  # type: ignore[attr-defined]
        name = getattr(x, "name", None)  # a named record (an optimizer's hyperparameters)
        name = name if isinstance(name, str) else type(x).__name__
        text = ", ".join(f"{k}={t}" for k, (t, _) in fields if k != "name" or name != x.name)
        return f"{name}({text})", frozen and all(f for _, (_, f) in fields)
    return type(x).__qualname__, False  # an object: its type only (no address, no state)


def _named(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and x[0].isidentifier()


def _function(fn: types.FunctionType, depth: int) -> tuple[str, bool]:
    """``factory(name=value, ...)``: the function's enclosing factory and what it closes over,
    with the closures of functions of the same factory merged in (``chain``'s lambdas)."""
    factory = fn.__qualname__.split(".<locals>")[0]
    values: dict[str, tuple[str, bool]] = {}
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            same = isinstance(value, types.FunctionType)
            if same and value.__qualname__.split(".<locals>")[0] == factory:
                todo.append(value)
            elif name not in values:
                values[name] = _describe(value, depth + 1)
    if not values:
        return factory, True
    text = ", ".join(f"{k}={t}" for k, (t, _) in sorted(values.items()))
    return f"{factory}({text})", all(f for _, f in values.values())
