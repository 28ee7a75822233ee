"""A checkpointed tree's layout: stable keys, one description per leaf, and the manifest file.

[Note: checkpoint keys]
A leaf's key is its key path joined with dots, with NamedTuple and dataclass fields by name:
``{"params": {"blocks.0.weight": w}, "opt": Adam(count=c, mu={...})}`` gives
``params.blocks.0.weight``, ``opt.count``, ``opt.mu.blocks.0.weight``. These are the keys DCP
gives a nested state dict, so a flat ``{fqn: tensor}`` tree is stored under the module's fqns, the
same keys as an FSDP2 model state dict (and readable in error messages). Two paths that join to
the same key (``{"a.b": x}`` and ``{"a": {"b": y}}``) are refused.

[Note: the manifest commits a checkpoint]
``funcshard.json`` is written last, by rank 0, into the temporary directory after DCP finished
writing every rank's data and its ``.metadata``; the directory is then renamed into place. A
directory counts as a funcshard checkpoint only with a readable manifest, so a save that stopped
at any point is never mistaken for a checkpoint. The manifest also lists every leaf (kind, shape,
dtype) so that ``load`` can compare ``like`` with what was saved before reading any data.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from .._trees._tree import PyTree
from ._rng import RNGState
from ._subclass import describe as subclass

MANIFEST = "funcshard.json"
FORMAT = "funcshard.checkpoint"
VERSION = 1
SCALARS = (bool, int, float, str)


def flatten(tree: PyTree, fn: str) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Leaves of ``tree`` with their checkpoint keys (see [Note: checkpoint keys]).

    Raises:
        TypeError: a leaf is not a tensor, a Python scalar or an RNGState.
        ValueError: two leaves have the same key.
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, none_is_leaf=False)
    keys = [".".join(str(_name(e)) for e in acc) or "<root>" for acc in accessors]
    seen: dict[str, int] = {}
    for i, (key, leaf) in enumerate(zip(keys, leaves, strict=True)):
        if not isinstance(leaf, (torch.Tensor, RNGState, *SCALARS)):
            raise TypeError(
                f"{fn}: {key!r} is a {type(leaf).__name__}; a checkpointed tree holds tensors "
                "(DTensors or plain), Python scalars (bool, int, float, str), "
                "fs.checkpoint.RNGState and None. Convert other values (e.g. a data loader's "
                "position to an int) before saving."
            )
        if key in seen:
            raise ValueError(
                f"{fn}: two leaves have the key {key!r} (paths {accessors[seen[key]]} and "
                f"{accessors[i]}); rename one of them so that their dotted paths differ."
            )
        seen[key] = i
    return keys, leaves, spec


def rank_key(key: str, rank: int, generator: str) -> str:
    """Where rank ``rank`` stores a generator of its RNGState leaf ``key``.

    See [Note: RNG states are per rank].
    """
    return f"{key}.rank{rank}.{generator}"


def _name(entry) -> Any:
    field = getattr(entry, "field", None)
    return entry.entry if field is None else field


def describe(leaf: Any) -> dict[str, Any]:
    """What the manifest records about a leaf (and what ``like`` is compared with)."""
    if isinstance(leaf, RNGState):
        return {"kind": "rng", "generators": {k: v.numel() for k, v in leaf.tensors().items()}}
    if isinstance(leaf, torch.Tensor):
        out = {"kind": "tensor", "shape": list(leaf.shape), "dtype": str(leaf.dtype)[6:]}
        if isinstance(leaf, DTensor):
            out["placements"] = [str(p) for p in leaf.placements]
            out["mesh"] = list(leaf.device_mesh.shape)
        return {**out, **subclass(leaf)}
    return {"kind": "scalar", "type": type(leaf).__name__}


def manifest(keys: list[str], leaves: list[Any], world: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world,
        "saved_at_ns": time.time_ns(),
        "torch": torch.__version__,
        "leaves": {k: describe(v) for k, v in zip(keys, leaves, strict=True)},
    }


def write_manifest(directory: str, content: dict[str, Any]) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(content, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest, or ``None`` if the directory has none (not a funcshard checkpoint).

    Raises:
        RuntimeError: the manifest exists but is not a valid funcshard manifest.
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            content = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RuntimeError(
            f"{path} is corrupted ({e}); this checkpoint cannot be trusted. Load an earlier one "
            "(fs.checkpoint.latest lists only intact ones)."
        ) from e
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise RuntimeError(f"{path} is not a funcshard manifest (no format {FORMAT!r}).")
    if content.get("version") != VERSION:
        raise RuntimeError(
            f"{path} has format version {content.get('version')}; this funcshard reads version "
            f"{VERSION}. Load it with the funcshard version that wrote it."
        )
    return content


def committed(directory: str) -> dict[str, Any] | None:
    """The manifest of a committed funcshard checkpoint at ``directory``, else ``None``."""
    try:
        return read_manifest(directory)
    except (RuntimeError, NotADirectoryError):
        return None
