"""``load`` a checkpoint into the structure, meshes and placements of a ``like`` tree.

[Note: loading is resharding]
DCP stores every tensor as chunks with their global offsets and reads, for each tensor it is
asked to fill, the overlapping parts of the saved chunks. ``load`` asks it to fill fresh tensors
placed like ``like``'s leaves, so a checkpoint saved on 2 ranks loads on 1 or 4, on a 1-D or a
2-D (HSDP) mesh, with ``Shard(0)`` or ``Shard(1)``, or into plain full tensors: bytes are copied,
never recomputed, so every value is bit for bit the saved one.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.tensor import DTensor

from .._communication import _liveness
from .._trees._tree import PyTree, _few, unflatten
from ._comm import distributed, peers_named, rank_world
from ._integrity import Reader, check_metadata, damaged
from ._layout import MANIFEST, describe, flatten, rank_key, read_manifest
from ._rng import RNGState, derive
from ._subclass import local_of, rebuilt
from ._subclass import targets as inner_targets


def load(path: str | os.PathLike, like: PyTree, *, strict: bool = True) -> PyTree:
    """Load the checkpoint at ``path`` into a new tree shaped and placed like ``like``.

    Collective (every rank calls it). ``like`` gives the structure and, per leaf, where the value
    goes: a DTensor's mesh and placements (its values are not read; a meta local tensor is
    enough, e.g. ``fs.shard(meta_params, mesh)``), a plain tensor's device (the full value), a
    scalar's type, or an :class:`RNGState` (this rank's saved states; see
    [Note: RNG states are per rank]). ``like`` itself is not modified. Also loads a plain
    ``torch.distributed.checkpoint`` directory (e.g. an FSDP2 model's state dict), whose keys are
    compared with ``like``'s the same way.

    Args:
        path: a checkpoint directory written by :func:`save` (or by DCP).
        like: a pytree whose leaves' keys (see [Note: checkpoint keys]) are in the checkpoint.
        strict: also require every saved key to be in ``like`` (default), so that nothing saved
            (the optimizer state, the RNG, the step) is silently left behind. ``False`` loads a
            part, e.g. only ``{"params": ...}`` of a training checkpoint.

    Returns:
        A tree with ``like``'s structure; tensors keep ``like``'s ``requires_grad``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RuntimeError: ``path`` is not a checkpoint, its manifest or ``.metadata`` is corrupted,
            a data file is truncated, or a byte read does not match the checksum saved in the
            manifest (each names the file, and the key where it applies; see
            [Note: checksums]).
        ValueError: ``like`` has a key the checkpoint lacks, a leaf of another shape, dtype or
            kind, or (with ``strict``) lacks a saved key.
    """
    _liveness.doing("fs.checkpoint.load")
    path = os.path.abspath(os.fspath(path))
    keys, leaves, spec = flatten(like, "load")
    saved, metadata, world, source, checksums = _saved(path)
    _check(source, saved, keys, leaves, strict)
    rank, _ = rank_world()
    src = rank % world
    targets: dict[str, Any] = {}
    for key, leaf in zip(keys, leaves, strict=True):
        if isinstance(leaf, RNGState):
            for name, t in leaf.tensors().items():
                targets[rank_key(key, src, name)] = torch.empty_like(t)
        elif local_of(leaf) is not None:  # see [Note: a subclass is saved as its inner ...]
            targets.update(inner_targets(key, leaf))
        else:
            targets[key] = _empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
    _check_files(path, metadata, targets)
    reader = (
        dcp.FileSystemReader(path)
        if checksums is None
        else Reader(path, checksums, metadata.storage_data or {})
    )
    with warnings.catch_warnings():  # DCP warns that it loads in one process without a group
        warnings.simplefilter("ignore", UserWarning)
        try:
            with peers_named("fs.checkpoint.load"):
                dcp.load(targets, storage_reader=reader, no_dist=not distributed())
        except dcp.CheckpointException as e:  # see [Note: damaged data files]
            raise (damaged(e) or _damaged(path, metadata, targets, e)) from None
    out = []
    for key, leaf in zip(keys, leaves, strict=True):
        if isinstance(leaf, RNGState):
            names = leaf.tensors()
            state = RNGState.from_tensors({n: targets[rank_key(key, src, n)] for n in names})
            out.append(state if rank < world else derive(state, rank))
        elif local_of(leaf) is not None:
            out.append(rebuilt(key, leaf, targets))
        elif isinstance(leaf, torch.Tensor):
            out.append(targets[key].requires_grad_(leaf.requires_grad))
        else:
            out.append(targets[key])
    return unflatten(spec, out)


def _saved(path: str) -> tuple[dict[str, dict], Metadata, int, str, dict | None]:
    """``(leaf descriptions, DCP metadata, saved world size, file to name in errors,
    checksums)``; the checksums are ``None`` for a checkpoint saved without them."""
    if not os.path.isdir(path):
        hint = " (fs.checkpoint.latest(dir) finds the newest checkpoint in a directory)"
        raise FileNotFoundError(f"no checkpoint directory {path}{hint}.")
    manifest = read_manifest(path)
    meta_file = os.path.join(path, ".metadata")
    if not os.path.exists(meta_file):
        held = _few(sorted(os.listdir(path)))
        detail = (
            "its manifest lists data DCP never finished writing"
            if manifest
            else f"it has neither {MANIFEST} nor .metadata (it holds {held or 'nothing'})"
        )
        raise RuntimeError(
            f"{path} is not a loadable checkpoint: {detail}. Pass a directory written by "
            "fs.checkpoint.save or torch.distributed.checkpoint.save."
        )
    checksums = manifest.get("checksums") if manifest is not None else None
    check_metadata(path, checksums)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        entries = metadata.state_dict_metadata
    except Exception as e:  # unpickling a damaged file fails in many ways
        raise RuntimeError(
            f"{meta_file} is corrupted ({type(e).__name__}: {e}); load an earlier checkpoint."
        ) from e
    if manifest is not None:
        source = os.path.join(path, MANIFEST)
        return manifest["leaves"], metadata, manifest["world_size"], source, checksums
    described = {
        k: {"kind": "object"}
        if isinstance(m, BytesStorageMetadata)
        else {"kind": "tensor", "shape": list(m.size), "dtype": str(m.properties.dtype)[6:]}
        for k, m in entries.items()
    }
    return described, metadata, 1, meta_file, None


def _check(source: str, saved: dict[str, dict], keys, leaves, strict: bool) -> None:
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(
            f"load: like has keys that {source} lacks: {_few(missing)}. It has "
            f"{_few(sorted(saved))}. Build like with the structure that was saved."
        )
    extra = sorted(set(saved) - set(keys))
    if strict and extra:
        raise ValueError(
            f"load: {source} has keys that like lacks: {_few(extra)}. Add them to like (the "
            "optimizer state, the step, the RNG states?), or pass strict=False to load a part."
        )
    for key, leaf in zip(keys, leaves, strict=True):
        want, have = describe(leaf), saved[key]
        if have["kind"] == "object" and want["kind"] == "scalar":
            continue  # a pickled value in a plain DCP checkpoint
        if any(
            want.get(f) != have.get(f)
            for f in ("kind", "shape", "dtype", "type", "generators", "subclass")
        ):
            raise ValueError(
                f"load: {key!r} is {_what(have)} in {source}, but {_what(want)} in like. Build "
                "like the way the saved tree was built (model configuration, dtype); convert "
                "after loading if you need another dtype."
            )


def _what(desc: dict) -> str:
    kind = desc["kind"]
    if kind == "tensor":
        what = f" {desc['subclass']}" if desc.get("subclass") else " tensor"
        return f"a {desc['dtype']}{what} of shape {desc['shape']}"
    if kind == "rng":
        return f"RNG states {desc['generators']}"
    return "a pickled object" if kind == "object" else f"a {desc['type']}"


def _empty_like(leaf: torch.Tensor) -> torch.Tensor:
    """A fresh tensor to load into, placed like ``leaf`` (meta leaves: on the mesh's device)."""
    if isinstance(leaf, DTensor):
        mesh, local = leaf.device_mesh, leaf.to_local()
        device = mesh.device_type if local.is_meta else local.device
        fresh = torch.empty(local.shape, dtype=leaf.dtype, device=device)
        return DTensor.from_local(
            fresh, mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
        )
    device = "cpu" if leaf.is_meta else leaf.device
    return torch.empty(leaf.shape, dtype=leaf.dtype, device=device)


def _check_files(path: str, metadata: Metadata, targets: dict[str, Any]) -> None:
    """Every data range the load reads exists: a clear error for truncated or missing files."""
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in targets:
            continue
        file = os.path.join(path, info.relative_path)
        if file not in sizes:
            sizes[file] = os.path.getsize(file) if os.path.exists(file) else -1
        end = info.offset + info.length
        if sizes[file] < end:
            state = "missing" if sizes[file] < 0 else f"truncated ({sizes[file]} bytes)"
            raise RuntimeError(
                f"{file} is {state}: key {index.fqn!r} is stored at bytes "
                f"{info.offset}..{end} of it. The checkpoint {path} is damaged; load an earlier "
                "one."
            )


def _damaged(path: str, metadata: Metadata, targets: dict, e: BaseException) -> RuntimeError:
    """The error for a load whose data could not be read, naming the damaged file and key.

    [Note: damaged data files]
    DCP reports any failure while reading as a ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` does not catch, whose text is the worker's traceback (for a file of the
    right size full of zeros: torch.load's ``invalid load key``, with its advice to try
    ``weights_only=False``). Every rank gets it (DCP gathers the failures), so every rank then
    reads its requested items again one by one, as DCP reads them (``torch.load`` of each
    item's byte range), to name the first one that cannot be read; that costs nothing when the
    load succeeds.
    """
    failures = getattr(e, "failures", {}) or {}
    first = next(iter(failures.values()), e)
    lines = str(first).strip().splitlines() or [""]
    cause = f"{type(first).__name__}: {lines[-1]}"
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in targets or info.transform_descriptors:
            continue
        file = os.path.join(path, info.relative_path)
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            tensor = not isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
            torch.load(data, map_location="cpu", weights_only=tensor)
        except Exception as bad:
            return RuntimeError(
                f"{file} is damaged: key {index.fqn!r}, stored at bytes {info.offset}.."
                f"{info.offset + info.length} of it, cannot be read ({type(bad).__name__}: "
                f"{bad}). The checkpoint {path} is damaged (overwritten or zero-filled); load an "
                "earlier one."
            )
    return RuntimeError(
        f"load: reading the data of {path} failed on rank(s) {sorted(failures)} ({cause}); its "
        "data files are damaged, or were changed while loading. Load an earlier checkpoint."
    )
