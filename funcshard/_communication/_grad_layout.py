"""Gradients of replicated parameters reduce-scattered straight into another layout (ZeRO-2).

[Note: gradients in the optimizer state's layout]
``fs.optim.shard_state`` keeps the state of a replicated parameter sharded (ZeRO-1): the
gradient is all-reduced whole, then the optimizer reads its share. ZeRO-2 reduce-scatters it
into that share directly: half the bytes of an all-reduce on the wire (a ring all-reduce is a
reduce-scatter and an all-gather), and no whole gradient kept once its group's backward is done.
``fs.value_and_grad(fn, grad_placements=fs.optim.state_placements)`` asks for it: every
differentiated DTensor leaf with a ``Replicate()`` mesh dim gets its gradient in the placements
``grad_placements(path, leaf)`` gives (a refinement of its own, as for ``shard_state``; ``None``
keeps its own), which ``shard_state`` with the same placements consumes as they are.

Autograd checks that a gradient has its input's shape, so a reduce-scattered block cannot flow
back to the parameter. Instead, while ``fn`` runs, an :class:`Into` is current (a context
variable scoped to the call, as the sink of ``sync_grads=False``), and ``unshard`` and
``schedule`` pass the full tensors they gather from those leaves through one :class:`_Capture`
node per gather (before a group's post-backward ``Notify``). Its backward runs when autograd has
all of that gather's gradients -- where the gather's own backward would have run -- reduces them
with :func:`._flat.scatter` into the target layouts (the call's ``grad_reduce``,
``reduce_dtype`` and counts; unused outputs reduce as zeros, as the gather's backward does), hands
the blocks to the ``Into`` and returns no gradient. ``value_and_grad`` asks autograd for the
gradient of the ``Into``'s anchor (a scalar every capture takes as an input) instead of those
leaves' local shards, so the gather's backward (the all-reduce) never runs. The node holds the
``Into`` weakly: nothing of a call is kept by a graph that outlives it. Plain autograd only (not
inside ``torch.func`` transforms or ``torch.compile``), 1-D layouts. A reduce-scatter is left
pending (see [Note: pending tensors] in ``_collectives``), so that it overlaps the next group's
backward, and waited when ``value_and_grad`` builds the gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._runtime._mode import Mode
from .._trees._spec import ShardSpec
from . import _collectives as C
from . import _flat

GradPlacements = Callable[[str, DTensor], tuple[Placement, ...] | None]

_CURRENT: contextvars.ContextVar[Into | None] = contextvars.ContextVar(
    "funcshard_into", default=None
)


class Into:
    """One ``value_and_grad`` call's targets (``{id(leaf): (path, target spec)}``), the anchor
    autograd is asked about, and the reduced blocks, accumulated per leaf."""

    def __init__(self, targets: dict[int, tuple[str, ShardSpec]]) -> None:
        self.targets = targets
        self.anchor = torch.zeros((), requires_grad=True)
        self.blocks: dict[int, torch.Tensor] = {}

    def add(self, ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Blocks may be pending (issued, not waited): waited when read."""
        for i, b in zip(ids, blocks, strict=True):
            self.blocks[i] = b if i not in self.blocks else C.wait(self.blocks[i]) + C.wait(b)

    def gradient(self, leaf: DTensor) -> DTensor:
        """``leaf``'s gradient in its target placements (zeros if no gather of it was used)."""
        spec = self.targets[id(leaf)][1]
        block = self.blocks.get(id(leaf))
        if block is None:
            block = torch.zeros(spec.level_shapes()[-1], dtype=leaf.dtype, device=leaf.device)
        return _placed(C.wait(block), spec)


def targets(
    paths, leaves, wanted, placements: GradPlacements, fn: str = "value_and_grad"
) -> dict[int, tuple[str, ShardSpec]]:
    """The leaves of one differentiated argument whose gradients go elsewhere: the
    differentiated (``wanted``) DTensors with a ``Replicate()`` mesh dim, each with its target
    spec (checked).

    Raises:
        ValueError: target placements that do not refine the leaf's, naming it.
        NotImplementedError: a replicated leaf of a 2-D (FSDP x TP) layout.
    """
    out = {}
    for path, x, w in zip(paths, leaves, wanted, strict=True):
        replicated = isinstance(x, DTensor) and any(isinstance(p, Replicate) for p in x.placements)
        if not (w and replicated):
            continue
        spec = ShardSpec.of(x)
        if spec.dp_dims is not None:
            raise NotImplementedError(
                f"{fn}: {path!r} is tensor parallel (FSDP x TP): grad_placements does not support "
                "2-D layouts yet. Drop grad_placements (the gradient comes back placed like the "
                "parameter) and let fs.optim.shard_state take its share."
            )
        want = tuple(placements(path, x) or x.placements)
        check_refines(path, tuple(x.placements), want, x.dim(), fn, "grad_placements")
        out[id(x)] = (path, ShardSpec(spec.mesh, want, spec.shape, spec.stride))
    return out


def check_refines(
    path: str,
    have: tuple,
    want: tuple,
    ndim: int,
    fn: str = "shard_state",
    what: str = "state placements",
) -> None:
    """``want`` keeps ``have``'s ``Shard`` mesh dims and shards only its ``Replicate()`` ones, on
    tensor dims (of ``ndim``) that ``have`` does not shard.

    Raises:
        ValueError: naming ``path`` and both placements.
    """
    sharded = {p.dim for p in have if isinstance(p, Shard)}
    ok = len(have) == len(want) and all(
        h == w or _shards_free_dim(h, w, sharded, ndim) for h, w in zip(have, want, strict=False)
    )
    if not ok:
        raise ValueError(
            f"{fn}: the {what} {want} of {path!r} do not refine its "
            f"placements {have}: keep the parameter's Shard dims, and shard only its "
            f"Replicate() mesh dims, on tensor dims (of its {ndim}) the parameter does not shard."
        )


def _shards_free_dim(have: Placement, want: Placement, sharded: set[int], ndim: int) -> bool:
    """``have`` is ``Replicate()`` and ``want`` shards a tensor dim that no mesh dim shards."""
    free = isinstance(want, Shard) and want.dim not in sharded and 0 <= want.dim < ndim
    return isinstance(have, Replicate) and free


def view(x: DTensor, target: tuple[Placement, ...]) -> DTensor:
    """This rank's block of ``x`` under ``target`` placements (a refinement of ``x``'s), as a
    view of ``x``'s local shard."""
    outer, inner = ShardSpec.of(x), ShardSpec(x.device_mesh, target, tuple(x.shape), x.stride())
    block = x.to_local()
    size = inner.level_shapes()[-1]
    for d, (a, b) in enumerate(zip(outer.local_offset(), inner.local_offset(), strict=True)):
        if size[d] != block.shape[d]:
            block = block.narrow(d, b - a, size[d])
    return _placed(block, inner)


def _placed(block: torch.Tensor, spec: ShardSpec) -> DTensor:
    return DTensor.from_local(
        block, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )


@contextlib.contextmanager
def collecting(into: Into | None) -> Iterator[None]:
    token = _CURRENT.set(into)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def captures(leaves: Sequence) -> bool:
    """Whether :func:`capture` may pass full tensors gathered from ``leaves`` through a node."""
    into = _CURRENT.get()
    return (
        into is not None and torch.is_grad_enabled() and any(id(x) in into.targets for x in leaves)
    )


def capture(leaves: Sequence, fulls: list[torch.Tensor], opts: _flat.Options) -> list:
    """``fulls`` (gathered from ``leaves``), those of the current :class:`Into`'s leaves passed
    through a :class:`_Capture` node (see [Note: gradients in the optimizer state's layout])."""
    into = _CURRENT.get()
    if into is None or not torch.is_grad_enabled():
        return fulls
    idx = [i for i, x in enumerate(leaves) if id(x) in into.targets and fulls[i].requires_grad]
    if not idx:
        return fulls
    specs = [into.targets[id(leaves[i])] for i in idx]
    layouts = tuple(_flat.Layout.stripped(path, spec, 0) for path, spec in specs)
    dtypes = tuple(leaves[i].dtype for i in idx)
    ids = tuple(id(leaves[i]) for i in idx)
    info = (weakref.ref(into), ids, layouts, dtypes, opts)
    outs = _Capture.apply(info, into.anchor, *(fulls[i] for i in idx))
    fulls = list(fulls)
    for i, out in zip(idx, outs, strict=True):
        fulls[i] = out
    return fulls


class _Capture(torch.autograd.Function):
    """Identity on the full tensors; backward: reduce their gradients into the target layouts
    and hand them to the :class:`Into` (no gradient flows further)."""

    @staticmethod
    def forward(info, anchor, *fulls):
        return tuple(C.alias(f) for f in fulls)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.info = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ref, ids, layouts, dtypes, opts = ctx.info
        into = ref()
        if into is not None:
            into.add(ids, _flat.scatter(list(grads), layouts, dtypes, opts, Mode.now()))
        return (None, None, *(None for _ in grads))
