"""Pytree helpers: flatten with readable key paths, and pair trees leaf by leaf.

funcshard's trees are optree trees with ``none_is_leaf=False``: ``None`` means "nothing here" and
is kept in place, untouched, by every transform. DTensors and :class:`~funcshard.LocalShard` are
leaves for optree (``LocalShard`` is a pytree *node* only for ``torch.utils._pytree``, which is what
``torch.func`` uses; see ``_spec.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

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


# [Note: a dict of tensors is flattened without optree]
# The trees an optimizer step reads -- the parameters of ``fs.extract``, their gradients, the
# moments, the step counts -- are most often one plain dict of tensors keyed by name, and a
# step pairs five or more of them. optree visits each leaf (a registry lookup, a node of the
# spec), which for such dicts cost more than torch.optim's own loop over its parameters (see
# BENCHMARKS.md); reading the values in optree's order, the sorted keys, is a few C calls.
# ``dict_leaves`` does so only where the result is optree's to the leaf: a plain ``dict`` (not
# a subclass, which optree may order otherwise) with sortable keys, whose values are tensors,
# DTensors or ``None`` (leaves for optree with ``none_is_leaf=True``). Two such dicts pair
# exactly when optree's specs of them compare equal: the same keys. Anything else takes
# optree's path; ``tests/test_tree.py`` checks the two agree.
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, DTensor, type(None)})


def dict_leaves(tree: PyTree, keys: list | None = None) -> tuple[list, list] | None:
    """``(keys, leaves)`` of a plain dict of tensors (``None`` entries kept as leaves), in
    optree's order; with ``keys``, only if ``tree``'s keys are exactly those. ``None`` where
    that does not hold: flatten with optree (see [Note: a dict of tensors is flattened without
    optree])."""
    if type(tree) is not dict:
        return None
    if keys is None:
        try:
            keys = sorted(tree)
        except TypeError:  # keys of several types: optree keeps the insertion order
            return None
    elif len(tree) != len(keys):
        return None
    try:
        leaves = [tree[k] for k in keys]
    except KeyError:
        return None
    return (keys, leaves) if _LEAF_TYPES.issuperset(map(type, leaves)) else None


@dataclasses.dataclass
class Flat:
    """A tree's leaves, ``None`` entries kept as leaves, in optree's order; and how to pair
    another tree with it or rebuild it (see [Note: a dict of tensors is flattened without
    optree])."""

    tree: PyTree
    leaves: list[Any]
    keys: list | None  # the sorted keys of a dict of tensors, read without optree

    @classmethod
    def of(cls, tree: PyTree) -> Flat:
        fast = dict_leaves(tree)
        if fast is not None:
            return cls(tree, fast[1], fast[0])
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        flat = cls(tree, leaves, None)
        flat.__dict__["spec"] = spec  # the cached property, known already
        return flat

    @functools.cached_property
    def spec(self) -> optree.PyTreeSpec:
        return optree.tree_structure(self.tree, none_is_leaf=True)

    def leaves_of(self, other: PyTree) -> list[Any] | None:
        """``other``'s leaves in this tree's order if the two have the same structure, else
        ``None``."""
        if self.keys is not None:
            fast = dict_leaves(other, self.keys)
            if fast is not None:
                return fast[1]
        leaves, spec = optree.tree_flatten(other, none_is_leaf=True)
        return leaves if spec == self.spec else None

    def paired(self, other: PyTree, *, what: str, like_what: str) -> list[Any]:
        """``other``'s leaves in this tree's order.

        Raises:
            ValueError: the structures differ, naming the keys (``other`` is ``what``, this
                tree ``like_what``).
        """
        leaves = self.leaves_of(other)
        if leaves is None:  # raises, naming the keys
            return flatten_like(other, self.tree, what=what, like_what=like_what, none_is_leaf=True)
        return leaves

    def rebuild(self, leaves: Sequence[Any]) -> PyTree:
        """A tree of this structure with ``leaves`` (in this tree's order)."""
        if self.keys is None:
            return unflatten(self.spec, leaves)
        by_key = dict(zip(self.keys, leaves, strict=True))
        return {k: by_key[k] for k in self.tree}  # the dict's own order, as optree rebuilds it

    def nones(self) -> PyTree:
        """A tree of this structure with ``None`` at every leaf."""
        if self.keys is None:
            return unflatten(self.spec, [None] * len(self.leaves))
        return dict.fromkeys(self.tree)


def nothing_in(tree: PyTree, like: PyTree) -> bool:
    """Whether ``tree`` is a dict of ``None`` with exactly the keys of ``like``, a dict of
    tensors: a tree of ``like``'s structure without a leaf to apply, told without flattening
    either (see [Note: a dict of tensors is flattened without optree])."""
    return (
        type(tree) is dict
        and type(like) is dict
        and all(v is None for v in tree.values())
        and tree.keys() == like.keys()
        and _LEAF_TYPES.issuperset(map(type, like.values()))
        # optree orders sortable keys, and keeps the insertion order of keys of several types
        and (list(tree) == list(like) or dict_leaves(like) is not None)
    )


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
