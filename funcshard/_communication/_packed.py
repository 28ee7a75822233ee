"""FSDP2's all-gather protocol: parameters that choose their own bytes on the wire.

[Note: FSDP2's all-gather protocol]
A parameter whose local shard is a tensor subclass with ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's float8 training weights and NF4 for QLoRA, MX formats) says
what is gathered for it, as FSDP2 lets it (``_fsdp_param.py``):

* ``inputs, metadata = shard.fsdp_pre_all_gather(mesh)`` -- or the five-argument form
  ``(mesh, outer_size, outer_stride, module, mp_policy)``, told apart by its signature as FSDP2
  does -- gives the tensors to gather, each along dim 0 (float8: the weight cast to float8,
  after an all-reduce of its amax over ``mesh``; NF4: its packed 4-bit data and scales);
* ``full, inner = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)`` rebuilds the full
  parameter from the gathered tensors (each the ranks' inputs concatenated along dim 0);
  a later gather into the same outputs calls it with ``out=full`` instead, which updates
  ``full`` in place (float8 sets its new scale).

funcshard calls them where it gathers (``_flat``): in every gather of a scheduled group, the
re-gather of a group freed after forward included (the hooks run again, so the same bytes are
gathered again, into the storage the first gather's full parameter still views), and in
``fs.unshard``. The full parameter is what the module computes with; its gradient (a plain
tensor of the parameter's logical shape and dtype, as float8's matmul returns it) is
reduce-scattered back to the shard like any other (``_flat.scatter``). ``module`` is passed as
``None``: funcshard gathers parameters, not modules. The mesh is the sharded mesh dim's.

[Note: one byte buffer per collective]
A bucket with such a parameter holds the whole group's parameters of its mesh and placement
kinds, whatever their dtypes, as FSDP2 gathers a group: each rank's inputs -- the hooks'
tensors, and the other shards (cast to ``param_dtype``, padded to equal chunks) -- are viewed as
bytes and copied into one ``uint8`` buffer, gathered by one all-gather, and split back into one
output per input (``[W * n]`` of its dtype, ranks in order). A ``uint8`` wire is what gloo
accepts for any dtype: float8 gathers there too (gloo has no float8 type; FSDP2 gathers a group
of float8 inputs alone in float8 and fails on gloo). The bytes are the inputs' own: nothing is
converted.

[Note: the ranks agree on what the hooks return]
The per-call agreement (``_consensus``) compares the shards' structure before any collective,
but the sizes a subclass's ``fsdp_pre_all_gather`` returns, and its metadata, are known only
when it runs, right before the all-gather: ranks that disagree there would gather buffers of
different sizes (gloo aborts the process) or rebuild different parameters. So the first gather
of each packed bucket of a lowered structure exchanges, through the store (no collective), every
rank's description of what its hooks returned -- per parameter: the inputs' shapes and dtypes
and the metadata's :func:`~funcshard._trees._subclass.describe` (tensors by dtype and shape) --
and raises the same ``ValueError`` on every rank, naming the first parameter that differs. Later
gathers of the same structure compare the sizes and dtypes sent with the agreed ones locally (a
change is an error naming the parameter on the rank that sees it); ``FUNCSHARD_DEBUG=1``
exchanges the whole description at every gather, so that every rank raises.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Shard
from torch.utils.weak import WeakTensorKeyDictionary

from .._runtime import _compile
from .._runtime._compile import untraced
from .._runtime._mode import Mode, transformed
from .._trees import _parallel
from .._trees._subclass import describe
from . import _collectives as C
from . import _consensus, _debug, _liveness
from ._rows import _from_rank_major, _pad, _refill

_BYTE = torch.uint8


@dataclasses.dataclass(frozen=True)
class Wire:
    """The static part of a packed bucket: per leaf, whether it speaks the protocol; the
    sharded mesh dim; the dtype handed to ``fsdp_post_all_gather`` (``None``: each shard's);
    what the ranks agreed they send (see [Note: the ranks agree on what the hooks return]),
    filled at the first gather."""

    speaking: tuple[bool, ...]
    mesh_dim: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    agreed: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class Packing:
    """A packed bucket's gather, issued: the all-gather of the bytes (``started``), the autograd
    inputs (``xs``, the armed shards), the shards whose hooks rebuild, and per leaf what was
    sent -- each input's shape and dtype -- and the hooks' metadata; with what its backward
    needs: the leaves' layouts, the call's options (``_flat.Options``, counted) and mode."""

    wire: Wire
    layouts: tuple
    opts: Any
    mode: Mode
    world: int
    sent: tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], ...]
    started: C.Started | None
    xs: tuple[torch.Tensor, ...]
    shards: tuple[torch.Tensor, ...]
    metadata: tuple[Any, ...]

    @property
    def traced(self) -> bool:
        return self.mode.traced


def check(layouts, speaking: Sequence[bool], mode: Mode) -> None:
    """Protocol leaves are gathered along dim 0 over one mesh dim (FSDP, or HSDP's shard dim),
    as FSDP2 gathers them, and not inside ``torch.func`` transforms (whose wrappers the hooks
    cannot see through).

    Raises:
        NotImplementedError: naming the parameters.
    """
    paths = [lay.path for lay, s in zip(layouts, speaking, strict=True) if s]
    if mode in (Mode.SYNCHRONOUS, Mode.TRACED_SYNCHRONOUS) and transformed():
        raise NotImplementedError(
            f"funcshard: {paths} are tensor subclasses with FSDP2's all-gather hooks "
            "(fsdp_pre_all_gather), which funcshard runs under plain autograd, torch.compile "
            "and CUDA graphs, not inside torch.func transforms: take gradients with "
            "fs.value_and_grad."
        )
    bad = []
    for lay, s in zip(layouts, speaking, strict=True):
        shards = [p for p in lay.spec.placements if isinstance(p, Shard)]
        if s and (len(shards) != 1 or shards[0].dim != lay.lead or lay.over != 1):
            bad.append(f"{lay.path} ({', '.join(map(str, lay.spec.placements))})")
    if bad:
        raise NotImplementedError(
            f"funcshard: {bad} use FSDP2's all-gather hooks (fsdp_pre_all_gather), gathered "
            "along dim 0 over one sharded mesh dim: shard them with Shard(0) on one mesh dim "
            "(FSDP, or HSDP's shard dim), without tensor or expert parallel dims."
        )


def pre_all_gather(
    shard: torch.Tensor,
    mesh,
    shape: Sequence[int],
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``(inputs, metadata)`` of ``shard.fsdp_pre_all_gather``, in whichever of its two forms
    its class has: ``mesh`` (the sharded mesh dim's), or also the full ``shape``, its
    contiguous stride, ``module=None`` and a ``MixedPrecisionPolicy`` of the dtypes."""
    hook = shard.fsdp_pre_all_gather
    if _arity(type(shard)) == 1:
        inputs, metadata = hook(mesh)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        shape = torch.Size(shape)
        inputs, metadata = hook(mesh, shape, tuple(C.contiguous_strides(shape)), None, policy)
    return tuple(inputs), metadata


def _pre(shard: torch.Tensor, layout, wire: Wire) -> tuple[tuple[torch.Tensor, ...], Any]:
    mesh = layout.spec.mesh
    mesh = mesh if mesh.ndim == 1 else _parallel.submesh(mesh, (wire.mesh_dim,))
    return pre_all_gather(shard, mesh, layout.levels[0], wire.param_dtype, wire.reduce_dtype)


_ARITIES: dict[type, int] = {}


def _arity(cls: type) -> int:
    """The number of parameters of ``cls.fsdp_pre_all_gather`` besides ``self`` (1 or 5)."""
    found = _ARITIES.get(cls)
    if found is None:
        found = len(inspect.signature(cls.fsdp_pre_all_gather).parameters) - 1
        if found not in (1, 5):
            raise TypeError(
                f"{cls.__name__}.fsdp_pre_all_gather takes {found} arguments besides self; "
                "FSDP2's protocol has (mesh) or (mesh, outer_size, outer_stride, module, "
                "mp_policy)."
            )
        _ARITIES[cls] = found
    return found


def issue(
    wire: Wire,
    layouts,
    xs: Sequence[torch.Tensor],
    shards: Sequence[torch.Tensor],
    comm: C.Comm,
    opts,
) -> Packing:
    """Run the hooks, pack every leaf's inputs into this rank's slot of one byte buffer and
    issue its all-gather (see [Note: one byte buffer per collective]). ``xs``: the shards as
    armed (the regular ones cast to the gather dtype), ``shards``: as passed (whose hooks run);
    ``opts``: the call's ``_flat.Options`` (with its counts), for the backward."""
    inputs, metadata = [], []
    _liveness.collective("fsdp_pre_all_gather", comm.group, opts.label)  # its own, if any
    with torch.no_grad():
        for lay, s, x, shard in zip(layouts, wire.speaking, xs, shards, strict=True):
            if s:
                ins, meta = _pre(shard, lay, wire)
            else:
                d = lay.dim(wire.mesh_dim)
                chunk = -(-lay.levels[wire.mesh_dim][d] // comm.world)
                cast = wire.param_dtype if x.is_floating_point() and wire.param_dtype else x.dtype
                ins, meta = (_pad(C.cast(x.detach(), cast), d, chunk),), None
            inputs.append(ins)
            metadata.append(meta)
    sent = tuple(tuple((tuple(t.shape), t.dtype) for t in ins) for ins in inputs)
    _agree(wire, layouts, sent, metadata, opts.label)
    pieces = [_bytes(t) for ins in inputs for t in ins]
    started = C.start_all_gather(dataclasses.replace(comm, gather_dtype=_BYTE), pieces, flat=True)
    return Packing(
        wire, tuple(layouts), opts, comm.mode, comm.world, sent, started, tuple(xs),
        tuple(shards), tuple(metadata),
    )  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t if t.dim() == 1 else t.reshape(-1)
    return flat if flat.dtype == _BYTE else flat.view(_BYTE)


def _agree(wire: Wire, layouts, sent, metadata, label: str) -> None:
    """See [Note: the ranks agree on what the hooks return]."""
    agreed = wire.agreed.get("sent")
    if agreed is not None and not _debug.enabled():
        if sent != agreed:  # the sizes sent: what the other ranks expect
            p = next(lay.path for lay, a, b in zip(layouts, sent, agreed, strict=True) if a != b)
            raise RuntimeError(
                f"funcshard: the fsdp_pre_all_gather of {p!r} returned other sizes or dtypes "
                "than at the earlier gathers, which the other ranks still gather. A subclass's "
                "hooks must return the same sizes at every gather of a structure."
            )
        return
    mine = {
        lay.path: f"inputs {[(list(s), str(d)) for s, d in shapes]}, metadata {describe(meta)}"
        for lay, s, shapes, meta in zip(layouts, wire.speaking, sent, metadata, strict=True)
        if s
    }
    with untraced():
        everyone = _consensus.each_rank(f"packed gather {label!r}", json.dumps(mine))
    tables = [json.loads(v) for v in everyone]
    for path in mine:
        seen = [t.get(path) for t in tables]
        if any(v != seen[0] for v in seen):
            by_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
            raise ValueError(
                f"funcshard: the ranks' fsdp_pre_all_gather of {path!r} disagree ({by_rank}). "
                "Every rank must gather inputs of the same shapes and dtypes, with the same "
                "metadata: shard the parameter evenly (dim 0 divisible by the number of ranks) "
                "and keep rank-dependent values out of its metadata."
            )
    wire.agreed["sent"] = sent


@dataclasses.dataclass(frozen=True)
class _Kept:
    """What a full parameter was rebuilt from: the gathered outputs it views and the inner
    tensors its ``fsdp_post_all_gather`` returned, whose storages are freed after forward and
    refilled for the ``out=`` form (FSDP2's ``all_gather_outputs`` and
    ``_unsharded_inner_tensors``)."""

    outputs: tuple[torch.Tensor, ...]
    inner: tuple[torch.Tensor, ...]


# Per full parameter rebuilt by the hooks, its _Kept: weakly keyed by the parameter, so nothing
# outlives it (the re-gather finds its outputs there; see [Note: FSDP2's all-gather protocol]).
_KEPT = WeakTensorKeyDictionary()


def owners(fulls: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The plain tensors holding the storage of ``fulls``: a rebuilt parameter's outputs and
    inner tensors (see :class:`_Kept`), any other tensor itself."""
    out = []
    for t in fulls:
        kept = _KEPT.get(t) if type(t) is not torch.Tensor else None
        out.extend((*kept.outputs, *kept.inner) if kept is not None else (t,))
    return out


def regathered(saved: torch.Tensor, old, new) -> torch.Tensor:
    """``saved`` -- a tensor subclass made from the full tensors ``old`` (a full parameter or,
    say, its transpose) -- re-made on ``new``, the same group gathered again: each inner tensor
    that views a gathered output views the new one the same way (see [Note: a plan under
    torch.compile] in ``_schedule``); the others (a scale) are kept."""
    names, ctx = saved.__tensor_flatten__()
    new_of = {id(_compile.root(o)): n for o, n in zip(owners(old), owners(new), strict=True)}
    inner = {}
    for name in names:
        t = getattr(saved, name)
        n = new_of.get(id(_compile.root(t)))
        # the outputs are bytes: the same view of the new ones, in the inner tensor's dtype
        inner[name] = t if n is None else _typed_like(_compile.root(n), t)
    return type(saved).__tensor_unflatten__(inner, ctx, saved.shape, saved.stride())


def _typed_like(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    buffer = buffer if buffer.dtype == t.dtype else buffer.view(t.dtype)
    return buffer.as_strided(t.shape, t.stride(), t.storage_offset())


def _outputs(p: Packing, into: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Wait for the all-gather; copy each input's column of the ``[W, S]`` bytes into its
    output in ``into`` (``W * n`` bytes each); return the outputs viewed in their inputs'
    dtypes, as the ranks' inputs concatenated along dim 0 (FSDP2's ``all_gather_outputs``)."""
    buffer = p.started.wait()
    rows = [o.view(p.world, -1) for o in into]
    sizes = [r.shape[1] for r in rows]
    with torch.autograd._unsafe_preserve_version_counter(tuple(into)):
        torch.split_with_sizes_copy(buffer.view(p.world, -1), sizes, 1, out=rows)
    if not p.traced:  # see [Note: releasing collective buffers] in _flat
        buffer.untyped_storage().resize_(0)
    sent = [x for leaf in p.sent for x in leaf]
    return [_typed(o, shape, dtype) for o, (shape, dtype) in zip(into, sent, strict=True)]


def _typed(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    out = out if dtype == _BYTE else out.view(dtype)
    return out if len(shape) == 1 else out.view(-1, *shape[1:])


def _new(leaf, world: int, device: torch.device) -> list[torch.Tensor]:
    """New outputs (bytes) for one leaf's inputs."""
    return [
        torch.empty(world * math.prod(s) * d.itemsize, dtype=_BYTE, device=device) for s, d in leaf
    ]


def _per_leaf(p: Packing, outs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    it = iter(outs)
    return [[next(it) for _ in leaf] for leaf in p.sent]


def rebuild(p: Packing) -> list[torch.Tensor]:
    """The full tensors of a first gather (see [Note: FSDP2's all-gather protocol]): the hooks'
    rebuilt parameters, and the other leaves' full tensors (views of their outputs)."""
    device = p.started.output.device
    new = [o for leaf in p.sent for o in _new(leaf, p.world, device)]
    gathered = _outputs(p, new)
    fulls = []
    for s, shard, outs, raw, meta, lay, sent in zip(
        p.wire.speaking, p.shards, _per_leaf(p, gathered), _per_leaf(p, new), p.metadata,
        p.layouts, p.sent, strict=True,
    ):  # fmt: skip
        if not s:
            fulls.append(_regular(outs[0], lay, sent[0][0], p))
            continue
        full, inner = shard.fsdp_post_all_gather(tuple(outs), meta, _dtype(p, shard))
        _KEPT[full] = _Kept(tuple(raw), tuple(inner))
        fulls.append(full)
    return fulls


def _dtype(p: Packing, shard: torch.Tensor) -> torch.dtype:
    return p.wire.param_dtype or shard.dtype


def _regular(out: torch.Tensor, lay, chunk: tuple[int, ...], p: Packing) -> torch.Tensor:
    """A regular leaf's full tensor from its output: the ranks' padded ``chunk``s."""
    d = lay.dim(p.wire.mesh_dim)
    size = lay.levels[p.wire.mesh_dim][d]
    # along dim 0, the ranks' chunks one after the other are the full tensor already
    full = out if d == 0 else _from_rank_major(out.view(p.world, -1), chunk, d)
    return full if full.shape[d] == size else full.narrow(d, 0, size)


def refill(p: Packing, targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A re-gather into the full tensors of the first one (their storage reallocated by the
    caller): the hooks' outputs refilled in place and ``fsdp_post_all_gather(..., out=)``;
    the regular leaves copied in. Under ``no_grad``."""
    into = []
    for s, leaf, target in zip(p.wire.speaking, p.sent, targets, strict=True):
        into.extend(_KEPT[target].outputs if s else _new(leaf, p.world, target.device))
    gathered = _outputs(p, into)
    for s, shard, outs, meta, lay, sent, target in zip(
        p.wire.speaking, p.shards, _per_leaf(p, gathered), p.metadata, p.layouts, p.sent, targets,
        strict=True,
    ):  # fmt: skip
        if s:
            shard.fsdp_post_all_gather(tuple(outs), meta, _dtype(p, shard), out=target)
        else:
            _refill(target, _regular(outs[0], lay, sent[0][0], p))
    return list(targets)
