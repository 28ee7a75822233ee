"""Which mesh dims each parameter of a plan's groups is gathered and reduced over: the
``meshes`` of :class:`~funcshard.Group`, read from the shards (see :meth:`Plan.with_meshes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._trees._parallel import layout_label
from .._trees._spec import spec_of


def meshes_of(groups: Sequence, sharded: Mapping[str, Any]) -> dict[str, tuple]:
    """``{group name: ((label, params), ...)}``, labels in order of first appearance.

    Raises:
        ValueError: a parameter of the groups is missing from ``sharded``.
        TypeError: a value is not a shard (DTensor or LocalShard).
    """
    missing = [p for g in groups for p in g.params if p not in sharded]
    if missing:
        raise ValueError(
            f"Plan.with_meshes: parameters {missing} of the groups are missing from sharded; "
            "pass the dict from fs.shard(fs.extract(module)[0], mesh) for this module."
        )
    out = {}
    for g in groups:
        by_label: dict[str, list[str]] = {}
        for p in g.params:
            label = layout_label(spec_of(p, sharded[p], "Plan.with_meshes"))
            by_label.setdefault(label, []).append(p)
        out[g.name] = tuple((label, tuple(ps)) for label, ps in by_label.items())
    return out
