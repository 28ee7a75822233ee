"""``on_meta``: build a module on the meta device and record how its constructor initialised it.

[Note: recording a constructor]
A constructor may initialise tensors outside their module's ``reset_parameters()``: ResNet's
``__init__`` re-draws every convolution with ``kaiming_normal_(mode="fan_out")`` and sets its
BatchNorms to 1 / 0; Hugging Face's ``Conv1D`` draws its weight in ``__init__``. On the meta device
those writes leave no values, only a bumped version counter, so ``materialize`` alone can tell
*that* a tensor was written, not *how*. Under ``on_meta()`` a dispatch mode records every in-place
op applied to a meta tensor (directly, or through ``.data`` / ``detach()``) with its arguments:
``nn.init`` computes fan-in/fan-out and bounds from the full meta shape before it calls
``normal_`` / ``uniform_`` / ``fill_``, so the recorded op already carries the full tensor's
constants. It also records the factory call that made a tensor's storage
(``nn.Parameter(torch.ones(d))``, ``torch.zeros(n)`` for a bias; not ``torch.empty``, which makes
no values): records are keyed by storage, which a ``Parameter`` shares with the tensor it wraps.
``materialize`` replays a tensor's record (factory, then writes) on its full real value, at its
module's turn, when the constructor wrote it more than (or instead of) its ``reset_parameters()``.
Replayed draws come from the stream at that point, so such tensors equal the normal build in
distribution (not bit for bit). A write that cannot be replayed from the tensor alone -- to part
of it (``w[0].zero_()``), or from another meta tensor whose value is not known
(``w.copy_(other)``: see below) -- is marked, and ``materialize`` names the module.

[Note: constants made in a constructor]
Some values are made from constants rather than initialised: CLIP's
``nn.Parameter(torch.tensor(2.6592))``, OpenCLIP's ``torch.ones([]) * math.log(1 / 0.07)``, a
rotary table ``1.0 / base ** (torch.arange(0, d, 2) / d)``. ``torch.tensor`` / ``torch.as_tensor``
copy their data without dispatching an operator, so a ``TorchFunctionMode`` (``_Data``) records
them, with the data as a CPU tensor. And while recording, the values of small constant meta
tensors (made from data, or by a factory that draws nothing: ``ones``, ``full``, ``arange``; up
to ``_KNOWN_LIMIT`` elements) are kept on the CPU beside them and follow their in-place writes:
an operator whose tensor inputs all have known values is computed on those too, and its
result is recorded as made from that constant. A tensor computed from a random one
(``torch.randn(n) * 0.02``) has no record: ``init`` must write it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode  # the one place it is used
from torch.utils._pytree import tree_flatten, tree_map


class _Op(NamedTuple):
    func: Any  # an aten OpOverload (a factory, or in place on its first argument) or nn.init's
    shape: tuple[int, ...]  # the shape it was applied at
    args: tuple  # the arguments after the first (a factory: all)
    kwargs: dict
    factory: bool = False


class _Record(NamedTuple):
    storage: torch.UntypedStorage  # the key, kept alive so that it is not reused
    creation: _Op | None  # the factory call that made it
    writes: list[_Op | None]  # in-place writes, in order (None: cannot be replayed)


@dataclass(frozen=True)
class Construction:
    """What a constructor wrote into meta tensors, from :func:`on_meta`; pass it to
    :func:`~funcshard.materialize` as ``construction=``. Filled while the ``with`` block runs."""

    _records: dict[torch.UntypedStorage, _Record] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"Construction({len(self._records)} tensors recorded)"


@contextlib.contextmanager
def on_meta() -> Iterator[Construction]:
    """``with torch.device("meta")`` that also records how the constructor initialised tensors.

    Yields a :class:`Construction` for :func:`~funcshard.materialize` (``construction=``), which
    then replays what a constructor did outside ``reset_parameters()`` (see [Note: recording a
    constructor]): e.g. ResNet's ``kaiming_normal_`` on every convolution; and the values it
    made from constants (see [Note: constants made in a constructor]): e.g. CLIP's
    ``nn.Parameter(torch.tensor(2.6592))``, a rotary table from ``torch.arange``.
    """
    construction = Construction()
    recorder = _Recorder(construction._records)
    with torch.device("meta"), _Data(recorder), recorder:
        yield construction


_NO_VALUES = ("empty", "empty_strided", "empty_like", "new_empty")
_KNOWN_LIMIT = 1 << 16  # elements: the largest constant whose value is kept while recording


def _constant(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The replay of a value made from a constant: the constant (see [Note: constants made in
    a constructor])."""
    return value.to(device)


class _Data(TorchFunctionMode):
    """Records the meta tensors ``torch.tensor`` / ``torch.as_tensor`` make from data (no
    operator is dispatched for them): see [Note: constants made in a constructor]."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = func in (torch.tensor, torch.as_tensor) and _is_meta(out)
        if made and not _has_meta(args, kwargs):  # from data, not from a meta tensor
            self.recorder.made(out, func(*args, **{**kwargs, "device": "cpu"}), always=True)
        return out


class _Recorder(TorchDispatchMode):
    def __init__(self, records: dict) -> None:
        super().__init__()
        self.records = records
        self.read: set[torch.UntypedStorage] = set()  # meta storages that ops take as input
        self.patched: list = []
        # the values of small constant meta storages, flat on the CPU (see [Note: constants
        # made in a constructor]); kept while recording only
        self.known: dict[torch.UntypedStorage, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        writes = target is not None and target.is_meta and _writes_first(func)
        if not func.is_view:
            inputs = tree_flatten((args[1:] if writes else args, kwargs))[0]
            self.read |= {x.untyped_storage() for x in inputs if _is_meta(x)}
        if writes:  # replayable with the values of its other meta arguments, if known
            rest = self.values(args[1:], kwargs)
            self.write(target, None if rest is None else _op(func, target.shape, *rest))
            self.follow(func, target, rest)
        elif _is_factory(func, args, kwargs, out):
            storage = out.untyped_storage()
            op = _op(func, out.shape, args, kwargs)._replace(factory=True)
            self.records[storage] = _Record(storage, op, [])
            value = _on_the_cpu(func, args, kwargs) if _computes(func) else None
            if value is not None:
                self.made(out, value, record=False)
        elif _is_meta(out) and _computes(func) and _has_meta(args, kwargs):
            found = self.values(args, kwargs)  # computed from known values only: a constant
            value = None if found is None else _on_the_cpu(func, *found)
            if value is not None and value.shape == out.shape:
                self.made(out, value.to(out.dtype))
        return out

    def made(self, meta: torch.Tensor, value: torch.Tensor, record=True, always=False) -> None:
        """``meta`` holds ``value`` (a CPU tensor of its shape): recorded as made from it, and
        its value kept if small enough (or ``always``: data the caller holds anyway)."""
        storage = meta.untyped_storage()
        if record:
            op = _Op(_constant, tuple(meta.shape), (value.detach().clone(),), {}, factory=True)
            self.records[storage] = _Record(storage, op, [])
        if always or meta.numel() <= _KNOWN_LIMIT:
            flat = torch.empty(
                storage.nbytes() // meta.element_size(), dtype=meta.dtype, device="cpu"
            )
            _viewed(flat, meta).copy_(value)
            self.known[storage] = flat

    def values(self, args, kwargs) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` with each meta tensor's known value on the CPU; ``None`` if one
        is not known."""
        unknown = []

        def value(x):
            if not _is_meta(x):
                return x
            flat = self.known.get(x.untyped_storage())
            if flat is None or flat.dtype != x.dtype:
                unknown.append(x)
                return x
            return _viewed(flat, x)

        found = tree_map(value, (tuple(args), kwargs))
        return None if unknown else found

    def follow(self, func, target: torch.Tensor, rest: tuple[tuple, dict] | None) -> None:
        """Apply an in-place write (its other arguments' values ``rest``) to ``target``'s known
        value; forget the value if the write draws or reads an unknown one."""
        storage = target.untyped_storage()
        if storage not in self.known:
            return
        done = rest is not None and not _draws(func)
        if done:
            known = _viewed(self.known[storage], target)
            done = _on_the_cpu(func, (known, *rest[0]), rest[1]) is not None
        if not done:
            del self.known[storage]

    def write(self, target: torch.Tensor, op: _Op | None) -> None:
        storage = target.untyped_storage()
        rec = self.records.setdefault(storage, _Record(storage, None, []))
        rec.writes.append(op if _whole(target) else None)

    def __enter__(self):
        self.patched = [(name, getattr(torch.nn.init, name)) for name in _SKIP_META]
        for name, _ in self.patched:
            setattr(torch.nn.init, name, _SKIP_META[name](self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, fn in self.patched:
                setattr(torch.nn.init, name, fn)


def _trunc_normal(recorder: _Recorder):
    """``nn.init``'s truncated normal, which returns early on meta tensors (no op, no version
    bump): on meta, recorded as a call of ``nn.init.trunc_normal_``, replayed as one."""
    original = torch.nn.init._no_grad_trunc_normal_

    def trunc_normal(tensor, mean, std, a, b, generator=None):
        if not tensor.is_meta:
            return original(tensor, mean, std, a, b, generator=generator)
        kwargs = {"mean": mean, "std": std, "a": a, "b": b}
        op = _Op(_TRUNC_NORMAL, tuple(tensor.shape), (), kwargs)
        recorder.write(tensor, op if generator is None else None)
        return tensor

    return trunc_normal


def _orthogonal(recorder: _Recorder):
    """``nn.init.orthogonal_``, a no-op on meta tensors: recorded as a call, replayed as one."""

    def orthogonal(tensor, gain=1, generator=None):
        if not tensor.is_meta:
            return _ORTHOGONAL(tensor, gain, generator=generator)
        op = _Op(_ORTHOGONAL, tuple(tensor.shape), (), {"gain": gain})
        recorder.write(tensor, op if generator is None else None)
        return tensor

    return orthogonal


# [Note: nn.init on meta] torch.nn.init's trunc_normal_ (through this helper, which every caller
# reaches, even one holding its own reference to trunc_normal_) and orthogonal_ (only callers
# that look it up on torch.nn.init) do nothing on meta tensors, so neither the dispatch mode nor a
# version counter sees them: while recording, torch.nn.init's attributes are swapped for
# recording versions (tests/test_materialize_models.py::test_on_meta_records_nn_init fails loudly
# if torch renames them).
_TRUNC_NORMAL = torch.nn.init.trunc_normal_
_ORTHOGONAL = torch.nn.init.orthogonal_
_SKIP_META = {"_no_grad_trunc_normal_": _trunc_normal, "orthogonal_": _orthogonal}


def _on_the_cpu(func, args, kwargs) -> torch.Tensor | None:
    """``func`` computed on the CPU (a factory's ``device`` set to it): a tensor, or ``None``
    if it fails there -- then the value is not known, and recording goes on."""
    kwargs = {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs
    try:
        out = func(*args, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    return out if isinstance(out, torch.Tensor) and not out.is_meta else None


def _computes(func) -> bool:
    """Whether ``func`` computes a new tensor's values from its inputs alone (no view, no draw,
    not an uninitialised one)."""
    return not (func.is_view or _draws(func) or func.overloadpacket.__name__ in _NO_VALUES)


def _draws(func) -> bool:
    """Whether ``func`` draws random numbers (its values are not a constant)."""
    return torch.Tag.nondeterministic_seeded in func.tags


def _viewed(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``flat`` (a storage's elements) that ``like`` views."""
    return flat.as_strided(like.shape, like.stride(), like.storage_offset())


def _writes_first(func) -> bool:
    info = func._schema.arguments[0].alias_info if func._schema.arguments else None
    return info is not None and info.is_write


def _is_factory(func, args, kwargs, out) -> bool:
    """A call that makes a fresh meta tensor with values from no tensor."""
    return (
        isinstance(out, torch.Tensor)
        and out.is_meta
        and not func.is_view
        and func.overloadpacket.__name__ not in _NO_VALUES
        and not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0])
    )


def _whole(t: torch.Tensor) -> bool:
    """``t`` covers its whole storage in order (the tensor itself, ``.data``, a reshape)."""
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _has_meta(args, kwargs) -> bool:
    return any(_is_meta(x) for x in tree_flatten((args, kwargs))[0])


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _op(func, shape, args, kwargs) -> _Op:
    """The op with its tensor arguments copied (a later write must not change the record)."""
    copy = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x
    return _Op(func, tuple(shape), tree_map(copy, tuple(args)), tree_map(copy, kwargs))


def recorded(construction: Construction | None, meta: torch.Tensor) -> tuple[list, list]:
    """What construction did to ``meta``: ``([its factory call] or [], its writes)`` (a write
    ``None``: one that cannot be replayed)."""
    rec = construction._records.get(meta.untyped_storage()) if construction else None
    if rec is None:
        return [], []
    return [rec.creation] if rec.creation is not None else [], list(rec.writes)


def replay(ops: list[_Op], value: torch.Tensor) -> None:
    """Apply recorded ops to ``value`` (real, full, of the recorded meta tensor's size)."""
    to = lambda x: x.to(value.device) if isinstance(x, torch.Tensor) else x
    with torch.no_grad():
        for op in ops:
            args, kwargs = tree_map(to, op.args), tree_map(to, op.kwargs)
            if op.factory:
                made = op.func(*args, **{**kwargs, "device": value.device})
                value.view(op.shape).copy_(made)
            else:
                op.func(value.view(op.shape), *args, **kwargs)
