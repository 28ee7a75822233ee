"""The whole training step as one CUDA graph: ``fs.cuda_graph(step)``.

[Note: a step as a graph]
A funcshard step is a pure function of its trees: its work depends only on the plan and the
inputs' structure, shapes and values of Python numbers, never on the tensors' contents (with the
optimizer's counts on the device: [Note: counts on the device] in ``optim/_adam_sgd``). Such a
step can be recorded once -- every gather, the forward, the backward, every reduce-scatter, the
optimizer update -- and replayed with one launch, with none of the host's per-op work.

``cuda_graph`` does what ``torch.cuda.make_graphed_callables`` does for a module, for a step over
trees:

- **Keys.** A call's key is the structure of its arguments, each tensor's type, shape, strides,
  dtype, device and placements, and every other leaf's value. Each key gets its own graph (at
  most ``max_graphs``, all in one memory pool); a call whose key is new after that is refused,
  naming the leaf that differs from the last call.
- **Warm-up.** The first ``warmup`` calls of a key run eagerly on a side stream (lazy
  initialisation, cuBLAS workspaces, NCCL communicators, as ``torch.cuda.graph`` asks). They
  also show which inputs the step *donates*: a tensor that the step returns as it received it
  (updated in place: the parameters and the optimizer state under ``fs.optim.step``).
- **Static inputs.** The capture runs the step on one slot per input tensor: a donated input is
  its own slot (the graph updates it in place, and the call returns it); any other input
  (the batch) gets a copy, into which every later call copies its value. A call passing the
  slot itself (the returned trees, as the next step does) copies nothing.
- **Outputs.** Outputs that are slots are returned as they are; the others (the loss) are the
  graph's own memory, overwritten by the next replay, and are returned as copies.
- **What the host does** -- plan, checks, the ranks' agreement through the store -- runs once,
  while capturing (see [Note: capture is a mode] in ``_mode``). What cannot be recorded is
  refused during the capture, naming the call in the step: a read of a device value on the
  host (``.item()``, ``bool(t)`` -- an ``if`` on a tensor --, ``.tolist()``, a copy to the CPU),
  and a CPU tensor used with device tensors (its value would be frozen). Control flow on Python
  values is not seen: it is part of the key when it comes from the arguments, frozen otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from .._runtime import _mode
from .._trees._dtensor import placed_like
from .._trees._subclass import fresh, inner, is_subclass
from .._trees._tree import flatten, unflatten
from ._host import HostReads
from ._signature import Keys, difference
from ._signature import local as _local


def _address(x: torch.Tensor) -> int:
    """Where ``x``'s (local) data is: a tensor subclass's (a low-precision weight), its first
    inner tensor's."""
    x = _local(x)
    return x.data_ptr() if type(x) is torch.Tensor or not is_subclass(x) else inner(x)[0].data_ptr()


class _Backend:
    """Records and replays on the GPU: ``torch.cuda.CUDAGraph`` in a shared pool."""

    def __init__(self) -> None:
        self.pool = None

    def warm(self, fn: Callable[[], Any]) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return out, graph.replay


class _Rerun:
    """The CPU stand-in of :class:`_Backend` (tests): "capture" runs the step in
    ``Mode.CAPTURED`` once, and a replay runs it again on the same slots, copying its new
    outputs into the first ones -- what a replay writes, without a GPU."""

    def warm(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        first = fn()
        ran = [True]  # the capture's run is the first replay's

        def replay() -> None:
            if ran[0]:
                ran[0] = False
                return
            again = fn()
            for a, b in zip(flatten(first)[1], flatten(again)[1], strict=True):
                if isinstance(a, torch.Tensor) and _address(a) != _address(b):
                    _local(a).copy_(_local(b))

        return first, replay


@dataclasses.dataclass
class _Entry:
    """One key's graph: its warm-up calls, donated inputs, slots and outputs."""

    calls: int = 0
    donated: frozenset[int] = frozenset()  # input leaf indices the step returns as received
    slots: list[Any] | None = None  # per input leaf: its slot (tensors), or the value
    local_slots: list[Any] = dataclasses.field(default_factory=list)  # their local tensors
    out: Any = None
    out_leaves: list[Any] = dataclasses.field(default_factory=list)
    out_spec: Any = None
    aliased: list[bool | None] = dataclasses.field(default_factory=list)  # output leaf is a slot
    replay: Callable[[], None] | None = None


class CudaGraphed:
    """``step`` run as CUDA graphs: see :func:`cuda_graph`. ``graphs``: how many were captured."""

    def __init__(self, step: Callable, warmup: int, max_graphs: int, backend=None) -> None:
        if not callable(step):
            raise TypeError(f"cuda_graph: step is a {type(step).__name__}, not a callable.")
        if not (isinstance(warmup, int) and warmup >= 1):
            raise ValueError(f"cuda_graph: warmup={warmup!r}; it must be an int >= 1.")
        if not (isinstance(max_graphs, int) and max_graphs >= 1):
            raise ValueError(f"cuda_graph: max_graphs={max_graphs!r}; it must be an int >= 1.")
        self.step, self.warmup, self.max_graphs = step, warmup, max_graphs
        self.backend = backend
        self.entries: dict[Any, _Entry] = {}
        self.last: Any = None  # the last call's key
        self.keys = Keys()  # the last call's leaves and their keys
        self.__wrapped__ = step

    @property
    def graphs(self) -> int:
        return sum(e.replay is not None for e in self.entries.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # no key paths here (strings per leaf per call): they are made when a message needs them
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        key = (spec, self.keys(leaves))
        entry = self.entries.get(key)
        backend = self._backend(leaves)
        if entry is None:
            entry = self._new_entry(key, args, kwargs, backend)
        self.last = key
        if entry.calls < self.warmup:
            entry.calls += 1
            out = backend.warm(lambda: self.step(*args, **kwargs))
            entry.donated = _donated(leaves, out) if entry.calls == 1 else (
                entry.donated & _donated(leaves, out)
            )  # fmt: skip
            return out
        if entry.replay is None:
            self._capture(entry, leaves, spec, backend)
        for x, slot, local in zip(leaves, entry.slots, entry.local_slots, strict=True):
            if x is not slot and local is not None and _address(x) != _address(local):
                local.copy_(_local(x))
        entry.replay()
        outs = entry.out_leaves
        fresh = [x.clone() if a is False else x for x, a in zip(outs, entry.aliased, strict=True)]
        return optree.tree_unflatten(entry.out_spec, fresh)

    def _backend(self, leaves: list) -> Any:
        if self.backend is None:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "cuda_graph: CUDA is not available here; a CUDA graph needs a GPU. Call the "
                    "step itself on this machine (fs.cuda_graph is for steps on CUDA devices)."
                )
            self.backend = _Backend()
        return self.backend

    def _new_entry(self, key, args, kwargs, backend) -> _Entry:
        paths, leaves, _ = flatten((args, kwargs), none_is_leaf=True)
        if isinstance(backend, _Backend):  # before the warm-up, which would train
            _refuse_host_tensors(paths, leaves)
        if len(self.entries) >= self.max_graphs:
            raise ValueError(
                f"cuda_graph: this call needs a new graph ({difference(self.last, paths, key)}), "
                f"but {len(self.entries)} are kept already (max_graphs={self.max_graphs}); "
                "each new structure, shape, dtype or Python value of the arguments is captured "
                "anew. Pad the batches to a few shapes, pass changing numbers as device "
                "tensors, or raise max_graphs."
            )
        entry = _Entry()
        self.entries[key] = entry
        return entry

    def _capture(self, entry: _Entry, leaves, spec, backend) -> None:
        device = next(
            (_local(x).device for x in leaves if isinstance(x, torch.Tensor)), None
        )  # fmt: skip
        slots = []
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                slots.append(x)
                continue
            if i in entry.donated:
                slots.append(x)
            else:
                copy = _copy(_local(x))
                slots.append(placed_like(copy, x) if isinstance(x, DTensor) else copy)
        args, kwargs = unflatten(spec, slots)
        checker = HostReads(device, "cuda_graph: the step cannot be captured")
        try:
            with _mode.capture(), checker:
                out, replay = backend.capture(lambda: self.step(*args, **kwargs))
        except Exception as e:
            found = checker.found or _host_read(e)
            if found is None:
                raise
            raise RuntimeError(f"cuda_graph: the step cannot be captured: {found}") from e
        ptrs = {_address(s) for s in slots if isinstance(s, torch.Tensor)}
        entry.slots, entry.out, entry.replay = slots, out, replay
        entry.local_slots = [_local(s) if isinstance(s, torch.Tensor) else None for s in slots]
        # per output leaf: True (a slot), False (the graph's memory: copied out), None (no tensor)
        entry.out_leaves, entry.out_spec = optree.tree_flatten(out, none_is_leaf=True)
        entry.aliased = [
            (_address(x) in ptrs) if isinstance(x, torch.Tensor) else None for x in entry.out_leaves
        ]


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A slot for ``x``: a copy of it (of a tensor subclass, made as ``fs.shard`` makes its
    shards: see [Note: sharding a tensor subclass])."""
    return fresh(x) if is_subclass(x) else x.detach().clone()


def _refuse_host_tensors(paths: list[str], leaves: list) -> None:
    for path, x in zip(paths, leaves, strict=True):
        if isinstance(x, torch.Tensor) and _local(x).device.type != "cuda":
            raise TypeError(
                f"cuda_graph: the argument {path!r} is a tensor on {_local(x).device}; a CUDA "
                "graph records only the GPU's work, so every replay would reuse the value it had "
                "at the capture. Put it on the GPU (an optimizer state made without "
                "capturable=True keeps its step counts on the CPU: fs.optim.adamw(..., "
                "capturable=True), or fused=True)."
            )


def _donated(leaves: list, out: Any) -> frozenset[int]:
    """Indices of input tensors that ``out`` holds as they were (the same storage)."""
    returned = {
        _address(x) for x in flatten(out, none_is_leaf=True)[1] if isinstance(x, torch.Tensor)
    }
    return frozenset(
        i for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and _local(x).numel() and _address(x) in returned
    )  # fmt: skip


def _host_read(e: BaseException) -> str | None:
    """What a CUDA error raised during a capture means, if it is one of capture's own."""
    text = " ".join(str(x) for x in (e, e.__cause__, e.__context__) if x is not None)
    if "capturing" in text or ("capture" in text.lower() and "cuda" in text.lower()):
        return (
            "the GPU refused an operation while capturing (a synchronisation: "
            "torch.cuda.synchronize, a blocking copy, an allocation outside the graph's pool, "
            f"or a host read): {str(e).splitlines()[0] if str(e) else type(e).__name__}."
        )
    return None


def cuda_graph(step: Callable, *, warmup: int = 2, max_graphs: int = 8) -> CudaGraphed:
    """``step`` captured as one CUDA graph per input layout, and replayed (see
    [Note: a step as a graph]).

    ``graphed = fs.cuda_graph(train_step)`` has ``train_step``'s signature and results. Typical
    use::

        opt = fs.optim.adamw(3e-4, capturable=True)     # or fused=True: counts on the GPU

        def train_step(params, state, batch):
            loss, grads = fs.value_and_grad(loss_fn)(params, batch)
            params, state = fs.optim.step(opt, params, grads, state)
            return loss, params, state

        step = fs.cuda_graph(train_step)
        for batch in batches:
            loss, params, state = step(params, state, batch)

    The first ``warmup`` calls of each layout run eagerly (and train); the next one captures the
    step and every call from then on replays it. Tensors the step returns as it received them
    (``params`` and ``state`` under ``fs.optim.step``) are *donated*: updated in place by every
    replay and returned as the same tensors; every other input tensor (the batch) is copied into
    the graph's static copy at each call. Other outputs (the loss) are returned as copies.

    Args:
        step: a function of tensors, trees of them and Python values, whose device work does
            not depend on tensor values (no ``.item()``, no ``if`` on a tensor); every tensor on
            the GPU. Optimizers of ``fs.optim`` need their counts on the device:
            ``adam``/``adamw(..., capturable=True)`` or ``fused=True``. It may be a
            ``torch.compile``'d step: the compiled code is captured (see [Note: a compiled
            step captured]).
        warmup: eager calls of each layout before its capture (>= 1).
        max_graphs: layouts captured at most (all share one memory pool); a call with another
            layout after that raises.

    Returns:
        A callable; ``.graphs`` counts the graphs captured.

    Raises (from a call):
        RuntimeError: no CUDA here; or the capture met what a graph cannot record (a host read,
            a CPU tensor with GPU tensors, a synchronisation), naming it and the line; or the
            optimizer's counts are on the host.
        TypeError: an argument is a CPU tensor.
        ValueError: a new layout after ``max_graphs``, naming the leaf that changed.
    """
    return CudaGraphed(step, warmup, max_graphs)
