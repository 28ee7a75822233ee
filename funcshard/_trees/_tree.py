"""Pytree helpers: flatten with readable key paths, and pair trees leaf by leaf.

funcshard's trees are optree trees with ``none_is_leaf=False``: ``None`` means "nothing here" and
is kept in place, untouched, by every transform. DTensors and :class:`~funcshard.LocalShard` are
leaves for optree (``LocalShard`` is a pytree *node* only for ``torch.utils._pytree``, which is what
``torch.func`` uses; see ``_spec.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree

PyTree = Any


def keystr(path: Sequence[Any]) -> str:
    """``('layers', 0, 'weight')`` -> ``"layers[0].weight"``; the empty path is ``"<root>"``."""
    try:
        return _keystr(tuple(path))  # trees are flattened every step: the same paths again
    except TypeError:  # an unhashable key
        return _keystr.__wrapped__(path)


@functools.lru_cache(maxsize=1 << 16)
def _keystr(path: tuple) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "<root>"


def flatten(
    tree: PyTree, *, none_is_leaf: bool = False
) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """Leaves of ``tree`` with their key paths as strings, and the spec to rebuild it.

    ``none_is_leaf=True`` keeps ``None`` entries as leaves, to pair a tree that has ``None`` in
    some places (gradients of frozen parameters) with one that has tensors there.
    """
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=none_is_leaf)
    return [keystr(p) for p in paths], leaves, spec


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any]) -> PyTree:
    return optree.tree_unflatten(spec, list(leaves))


def map_with_path(fn: Callable[[str, Any], Any], tree: PyTree) -> PyTree:
    """``fn(path, leaf)`` on every leaf; ``path`` is the readable key path."""
    paths, leaves, spec = flatten(tree)
    return unflatten(spec, [fn(p, leaf) for p, leaf in zip(paths, leaves, strict=True)])


def flatten_like(
    tree: PyTree, like: PyTree, *, what: str, like_what: str, none_is_leaf: bool = False
) -> list[Any]:
    """Leaves of ``tree`` in the order of ``like``'s leaves; a clear error if the structures differ.

    Raises:
        ValueError: naming the key paths present in one tree and not in the other.
    """
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=none_is_leaf)
    like_spec = optree.tree_structure(like, none_is_leaf=none_is_leaf)
    if spec == like_spec:
        return leaves
    like_paths, _, like_spec = flatten(like, none_is_leaf=none_is_leaf)
    paths, leaves, spec = flatten(tree, none_is_leaf=none_is_leaf)
    missing = sorted(set(like_paths) - set(paths))
    extra = sorted(set(paths) - set(like_paths))
    detail = []
    if missing:
        detail.append(f"missing from {what}: {_few(missing)}")
    if extra:
        detail.append(f"not in {like_what}: {_few(extra)}")
    if not detail:
        detail.append(f"{what} has structure {spec}, {like_what} has {like_spec}")
    raise ValueError(
        f"{what} does not match the structure of {like_what} ({'; '.join(detail)}). "
        f"Pass a tree with exactly one entry per leaf of {like_what}, with the same keys."
    )


def _few(names: Sequence[str], n: int = 6) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")
