"""``Flat``: a tree's leaves read without optree where that gives optree's own answer.

The reference is optree itself (``none_is_leaf=True``): the same leaves in the same order, the
same rebuilt tree (keys in the same order), and two trees paired exactly when optree's specs of
them compare equal.
"""

from __future__ import annotations

import optree
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from funcshard._trees._tree import Flat, dict_leaves

_TENSOR, _PARAM = torch.zeros(1), torch.nn.Parameter(torch.zeros(2))
leaf = st.sampled_from([_TENSOR, _PARAM, None])
# values that make optree's path necessary: containers, and leaves of other types
other = st.one_of(
    st.integers(),
    st.lists(leaf, max_size=2),
    st.dictionaries(st.text(max_size=2), leaf, max_size=2),
)
keys = st.one_of(st.text(max_size=4), st.integers(-3, 3))
trees = st.one_of(
    st.dictionaries(st.text(max_size=4), leaf, max_size=8),
    st.dictionaries(keys, st.one_of(leaf, other), max_size=6),
    st.lists(leaf, max_size=4),
)


def _same_leaves(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _items(tree):
    """The structure and key order, leaves by identity."""
    if isinstance(tree, dict):
        return [(type(tree), k, _items(v)) for k, v in tree.items()]
    if isinstance(tree, list):
        return [(list, _items(v)) for v in tree]
    return id(tree)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_flat_is_optrees_flatten(tree):
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    flat = Flat.of(tree)
    assert _same_leaves(flat.leaves, leaves)
    assert flat.spec == spec
    fresh = [torch.ones(1) for _ in leaves]
    assert _items(flat.rebuild(fresh)) == _items(optree.tree_unflatten(spec, fresh))


@settings(max_examples=300, deadline=None)
@given(trees, trees)
def test_flat_pairs_a_tree_as_optree_does(tree, other_tree):
    ref, ref_spec = optree.tree_flatten(other_tree, none_is_leaf=True)
    paired = Flat.of(tree).leaves_of(other_tree)
    if ref_spec == optree.tree_structure(tree, none_is_leaf=True):
        assert paired is not None and _same_leaves(paired, ref)
    else:
        assert paired is None


def test_a_dict_of_tensors_takes_the_fast_path_in_optrees_order():
    """The case the optimizer sees every step: sorted keys, as optree orders a dict; the same
    keys in another insertion order pair; one key more or less does not."""
    tree = {"b": _TENSOR, "a": None, "c": _PARAM}
    assert dict_leaves(tree) == (["a", "b", "c"], [None, _TENSOR, _PARAM])
    assert Flat.of(tree).keys == ["a", "b", "c"]
    assert Flat.of(tree).leaves_of({"c": 1.0, "b": None, "a": _TENSOR}) is not None
    assert dict_leaves({"c": 1.0, "b": None, "a": _TENSOR}, ["a", "b", "c"]) is None  # a float
    assert Flat.of(tree).leaves_of({"a": None, "b": None}) is None
    assert Flat.of(tree).leaves_of({"a": None, "b": None, "d": None}) is None
    assert list(Flat.of(tree).rebuild([1, 2, 3])) == ["b", "a", "c"]  # the dict's own order
    assert dict_leaves({1: _TENSOR, "a": _TENSOR}) is None  # unsortable keys: optree's path


@settings(max_examples=200, deadline=None)
@given(trees, trees)
@example({}, {"": _TENSOR, 0: _TENSOR})  # keys of several types: optree keeps their order
@example({0: None, "": None}, {"": _TENSOR, 0: _TENSOR})
def test_nothing_in_is_a_tree_of_nones_shaped_like(tree, like):
    """``nothing_in``: exactly when optree sees ``tree`` as ``like``'s structure with no leaf
    but ``None`` -- told only for dicts of tensors (else it says no, and the caller flattens)."""
    from funcshard._trees._tree import nothing_in

    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    same = spec == optree.tree_structure(like, none_is_leaf=True)
    if nothing_in(tree, like):
        assert same and all(x is None for x in leaves)
    if same and all(x is None for x in leaves) and dict_leaves(like) is not None:
        assert nothing_in(tree, like)
    of_tensors = type(like) is dict and all(
        v is None or isinstance(v, torch.Tensor) for v in like.values()
    )
    assert nothing_in(Flat.of(like).nones(), like) == of_tensors
