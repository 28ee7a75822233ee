"""Full ``state_dict``s in and out: ``export_state_dict`` (shards -> one rank, optionally a file)
and ``import_state_dict`` (a file or dict -> shards, each rank reading only its slices).

[Note: exporting without a full copy per rank]
``export_state_dict`` moves one tensor at a time: each rank that holds a distinct piece of it
(coordinate 0 on every ``Replicate`` mesh dim, non-empty) sends its local shard to the target
rank, which copies it into the full tensor at the piece's offset. The target rank ends with the
full model (once); the other ranks never hold more than their own shards. Tied names (from
:func:`funcshard.extract`'s record, or live ties) get the same tensor object, which is what
``module.load_state_dict`` and ``torch.save`` expect.

[Note: ties in safetensors]
safetensors refuses tensors that share memory, and inference tools expect a tied weight stored
once (``safetensors.torch.save_model`` drops the duplicates). The exported file therefore holds
each tensor once, under its first name, and lists the aliases in its metadata
(``"funcshard.aliases"``), which ``import_state_dict`` reads back.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)

from .._trees._extract import aliases
from .._trees._subclass import is_subclass
from .._trees._tree import _few
from ._comm import on_rank, rank_world

_ALIASES_KEY = "funcshard.aliases"


def export_state_dict(
    params: Mapping[str, torch.Tensor],
    module: nn.Module | None = None,
    *,
    buffers: Mapping[str, torch.Tensor] | None = None,
    path: str | os.PathLike | None = None,
    to: int = 0,
) -> dict[str, torch.Tensor] | None:
    """The full state dict of sharded ``params`` (and ``buffers``) on rank ``to``; collective.

    Args:
        params: ``{fqn: DTensor or tensor}``, e.g. ``fs.shard(fs.extract(module)[0], mesh)``.
        module: the module they come from (may be on meta). Then the result has exactly the keys
            of ``module.state_dict()``, in its order, tied names included, so that
            ``fresh_module.load_state_dict(result)`` (``strict=True``) accepts it.
        buffers: ``{fqn: tensor}`` (the same on every rank), e.g. ``fs.extract(module)[1]``.
        path: also write the result there, atomically, from rank ``to`` (the file exists on
            return, on every rank): safetensors if it ends with ``.safetensors`` (each tied
            tensor once; see [Note: ties in safetensors]), else ``torch.save``.
        to: the rank that receives the full tensors.

    Returns:
        On rank ``to``: ``{name: full CPU tensor}`` (detached); on the other ranks: ``None``.
        See [Note: exporting without a full copy per rank].

    Raises:
        ValueError: a key of ``module.state_dict()`` is in neither ``params`` nor ``buffers`` (or
            has another shape), a key is in both, or one is not the module's.
    """
    given = {**params, **(buffers or {})}
    if len(given) != len(params) + len(buffers or {}):
        both = sorted(set(params) & set(buffers or {}))
        raise ValueError(f"export_state_dict: {_few(both)} are in both params and buffers.")
    names = _names(given, module)
    rank, _ = rank_world()
    full = {src: _gather(given[src], to) for src in dict.fromkeys(names.values())}
    out = {name: full[src] for name, src in names.items()} if rank == to else None
    if path is not None:  # on every rank: the file exists (or the error is raised) on return
        tied = {n: s for n, s in names.items() if n != s}
        on_rank(lambda: _write(os.fspath(path), out, tied), src=to)
    return out


def _names(given: Mapping[str, torch.Tensor], module: nn.Module | None) -> dict[str, str]:
    """``{state dict name: key of given holding its value}``."""
    if module is None:
        return {k: k for k in given}
    tied = aliases(module)
    expected = module.state_dict(keep_vars=True)
    names, where = {}, f"{type(module).__name__}.state_dict()"
    for name, ref in expected.items():
        src = name if name in given else tied.get(name)
        if src not in given:
            raise ValueError(
                f"export_state_dict: {where} has {name!r}, which is in neither params nor "
                "buffers; pass buffers=fs.extract(module)[1] (or the tree that holds it)."
            )
        if tuple(given[src].shape) != tuple(ref.shape):
            raise ValueError(
                f"export_state_dict: {name!r} has shape {list(given[src].shape)}, but {where} "
                f"has {list(ref.shape)}; pass the module these parameters belong to."
            )
        names[name] = src
    non_persistent = {k for k, _ in module.named_buffers()} - set(expected)
    unknown = sorted(set(given) - set(names.values()) - non_persistent)
    if unknown:
        raise ValueError(
            f"export_state_dict: {_few(unknown)} are not in {where}; pass the matching module."
        )
    return names


def _gather(t: torch.Tensor, dst: int) -> torch.Tensor | None:
    """The full value of ``t`` on rank ``dst`` (``None`` elsewhere), piece by piece."""
    rank, _ = rank_world()
    if not isinstance(t, DTensor):
        return t.detach().cpu().clone() if rank == dst else None
    if any(type(p) not in (Shard, Replicate) for p in t.placements):
        raise ValueError(
            f"export_state_dict: placements {t.placements} are not Shard/Replicate; "
            "redistribute the tensor first."
        )
    shape, grid, local = tuple(t.shape), t.device_mesh.mesh, t.to_local().detach()
    if is_subclass(local):  # a low-precision weight: its value in its dtype (NF4: dequantized)
        local = local.to(t.dtype)
    full = torch.empty(shape, dtype=t.dtype) if rank == dst else None
    for coord in itertools.product(*map(range, grid.shape)):
        if any(isinstance(p, Replicate) and c for p, c in zip(t.placements, coord, strict=True)):
            continue  # a replica of a piece sent from coordinate 0 of that mesh dim
        src = int(grid[coord])
        piece, offset = _compute_local_shape_and_global_offset(
            shape, tuple(grid.shape), list(coord), t.placements
        )
        if math.prod(piece) == 0 or rank not in (src, dst):
            continue
        region = tuple(slice(o, o + n) for o, n in zip(offset, piece, strict=True))
        if src == rank == dst:
            full[region] = local
        elif src == rank:
            dist.send(local.contiguous(), dst)
        else:
            buf = torch.empty(piece, dtype=t.dtype, device=local.device)
            dist.recv(buf, src)
            full[region] = buf
    return full


def _write(path: str, state_dict: dict[str, torch.Tensor], tied: dict[str, str]) -> None:
    tmp = f"{path}.tmp"
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        stored = {k: v.contiguous() for k, v in state_dict.items() if k not in tied}
        save_file(stored, tmp, metadata={"format": "pt", _ALIASES_KEY: json.dumps(tied)})
    else:
        torch.save(state_dict, tmp)
    os.replace(tmp, path)


class _Source(NamedTuple):
    """A full state dict to read slices of: its names, ``{alias: stored name}``, readers."""

    where: str
    names: list[str]
    tied: dict[str, str]
    shape: Callable[[str], tuple[int, ...]]
    read: Callable[[str, tuple[slice, ...]], torch.Tensor]


def import_state_dict(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    like: Mapping[str, torch.Tensor | None],
    *,
    strict: bool = True,
) -> dict[str, torch.Tensor | None]:
    """Shards of a full state dict, placed like ``like``; each rank reads only its own slices.

    No communication. ``source`` is a ``.safetensors`` file (read with ``safe_open``, slice by
    slice), another file (``torch.load(mmap=True, weights_only=True)``: pages are read on
    touch), or a mapping of full tensors. ``like`` is ``{name: DTensor or tensor}`` giving the
    mesh, placements and dtype of each result (a meta local tensor is enough, e.g.
    ``fs.shard(fs.extract(meta_module)[0], mesh)``); values are cast to ``like``'s dtype.

    Args:
        strict: also require every tensor of ``source`` to be used (tied aliases of a used name
            count as used).

    Raises:
        KeyError: a name of ``like`` is not in ``source``.
        ValueError: a shape differs; with ``strict``, ``source`` has unused names.
    """
    src = _open(source)
    out: dict[str, torch.Tensor | None] = {}
    used = set()
    for name, t in like.items():
        if t is None:
            out[name] = None
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"import_state_dict: like[{name!r}] is a {type(t).__name__}; pass tensors (meta "
                "DTensor shards from fs.shard, or plain tensors) that say where each value goes."
            )
        stored = name if name in src.names else src.tied.get(name)
        if stored not in src.names:
            raise KeyError(
                f"import_state_dict: {name!r} is not in {src.where} (it has "
                f"{_few(sorted(src.names))}); rename the keys of like to match."
            )
        if src.shape(stored) != tuple(t.shape):
            raise ValueError(
                f"import_state_dict: {name!r} has shape {list(src.shape(stored))} in {src.where}, "
                f"like has {list(t.shape)}; build like from the same model configuration."
            )
        used.add(stored)
        out[name] = _slice(src, stored, t).requires_grad_(t.requires_grad)
    unused = [n for n in src.names if src.tied.get(n, n) not in used]
    if strict and unused:
        raise ValueError(
            f"import_state_dict: {src.where} has tensors that like does not use: {_few(unused)}; "
            "add them to like, or pass strict=False."
        )
    return out


def _slice(src: _Source, name: str, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(like, DTensor):
        return src.read(name, ()).to(
            device="cpu" if like.is_meta else like.device, dtype=like.dtype
        )
    mesh, local = like.device_mesh, like.to_local()
    piece, offset = compute_local_shape_and_global_offset(like.shape, mesh, like.placements)
    region = tuple(slice(o, o + n) for o, n in zip(offset, piece, strict=True))
    device = mesh.device_type if local.is_meta else local.device
    data = src.read(name, region).to(device=device, dtype=like.dtype).contiguous()
    return DTensor.from_local(
        data, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _open(source) -> _Source:
    if isinstance(source, Mapping):
        return _from_mapping(source, "the source state dict")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"import_state_dict: no file {path}.")
    if not path.endswith(".safetensors"):
        sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(sd, Mapping):
            raise ValueError(f"import_state_dict: {path} holds a {type(sd).__name__}, not a dict.")
        return _from_mapping(sd, path)
    from safetensors import safe_open

    f = safe_open(path, framework="pt", device="cpu")
    tied = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    return _Source(
        path,
        list(f.keys()),
        tied,
        lambda n: tuple(f.get_slice(n).get_shape()),
        lambda n, region: f.get_slice(n)[region] if region else f.get_tensor(n),
    )


def _from_mapping(sd: Mapping[str, torch.Tensor], where: str) -> _Source:
    first: dict[tuple, str] = {}
    tied = {}
    for name, t in sd.items():
        if t.numel() == 0:
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        tied_to = first.setdefault(ident, name)
        if tied_to != name:
            tied[name] = tied_to
    return _Source(
        where,
        list(sd),
        tied,
        lambda n: tuple(sd[n].shape),
        lambda n, region: sd[n][region].clone(memory_format=torch.contiguous_format),
    )
