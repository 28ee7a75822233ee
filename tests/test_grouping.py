"""``group`` and the policies, against FSDP1's own wrapping code run with a recording wrapper.

The reference is torch's ``torch.distributed.fsdp.wrap._recursive_wrap`` (which modules FSDP1
wraps) followed by the assignment of FSDP1's ``_get_fully_sharded_module_to_states`` (torch 2.0)
(which parameters each wrapped module owns), re-implemented below. Ignored modules and
parameters go through FSDP1's ``_get_ignored_modules`` / ``_get_ignored_params``.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp._init_utils import _get_ignored_modules, _get_ignored_params
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    _or_policy,
    _recursive_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
)

import funcshard as fs

from _mesh import mesh
from _models import Block, TinyLM

# ---------------------------------------------------------------------------------------------
# The reference: FSDP1's auto wrap (recording, not wrapping) + FSDP1's assignment.


def fsdp1_groups(module, torch_policy, ignored_modules=(), ignored_params=()):
    """``(groups, visits)``: FSDP1's grouping of a deep copy of ``module``, keyed by fqn.

    ``visits`` counts how often ``_recursive_wrap`` entered each module (by fqn): more than once
    means FSDP1 walked (and may have wrapped) a shared module twice.
    """
    module = copy.deepcopy(module)  # _recursive_wrap setattr()s every child it visits
    by_name = dict(module.named_modules())
    params = dict(module.named_parameters(remove_duplicate=False))
    ims = _get_ignored_modules(module, [by_name[n] for n in ignored_modules])
    ips = _get_ignored_params(module, ims, [params[n] for n in ignored_params])
    visits: Counter[nn.Module] = Counter()

    def counting_policy(module, recurse, nonwrapped_numel):
        visits[module] += recurse
        return torch_policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    wrapped: set[nn.Module] = set()

    def record(m, **kwargs):  # FSDP1's _record_module_wrapper_cls
        wrapped.add(m)
        return m

    _recursive_wrap(module, counting_policy, record, ims, ips, only_wrap_children=False)
    wrapped.add(module)  # the root is always a group
    return _assign(module, wrapped, ips), {n: visits[m] for n, m in by_name.items()}


def _assign(root, wrapped, ignored_params):
    """FSDP1's assignment: DFS from each wrapped module (in .modules() order) not entering other
    wrapped modules; each parameter goes to the first group that reaches it."""
    fqn = {id(p): n for n, p in root.named_parameters()}  # first name of a tied parameter
    visited = {id(p) for p in ignored_params}
    groups = {}
    for name, m in root.named_modules():
        if m not in wrapped:
            continue
        owned, stack = [], [m]
        while stack:
            sub = stack.pop()
            for p in sub.parameters(recurse=False):
                if id(p) not in visited:
                    visited.add(id(p))
                    owned.append(fqn[id(p)])
            stack.extend(c for c in reversed(list(sub.children())) if c not in wrapped)
        groups[name] = owned
    return groups


# ---------------------------------------------------------------------------------------------
# Random module trees and policies.


class Custom(nn.Module):
    """A user module with a parameter of its own beside its children."""

    def __init__(self, d, children):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        for i, c in enumerate(children):
            self.add_module(f"c{i}", c)


DIMS = (2, 4)
LEAVES = ("linear", "layernorm", "mha", "relu", "embedding")
CONTAINERS = ("sequential", "modulelist", "moduledict", "custom")


@st.composite
def trees(draw, max_depth=3):
    """A random module tree with shared submodules and tied parameters."""
    built: list[nn.Module] = []  # finished modules: sharing one of them cannot make a cycle

    def node(depth):
        if built and draw(st.integers(0, 4)) == 0:
            return draw(st.sampled_from(built))
        kinds = LEAVES + (CONTAINERS if depth < max_depth else ())
        kind = draw(st.sampled_from(kinds))
        d = draw(st.sampled_from(DIMS))
        if kind == "linear":
            m = nn.Linear(d, draw(st.sampled_from(DIMS)), bias=draw(st.booleans()))
        elif kind == "layernorm":
            m = nn.LayerNorm(d, elementwise_affine=draw(st.booleans()))
        elif kind == "mha":
            m = nn.MultiheadAttention(4, draw(st.sampled_from((1, 2))), bias=draw(st.booleans()))
        elif kind == "relu":
            m = nn.ReLU()
        elif kind == "embedding":
            m = nn.Embedding(draw(st.sampled_from(DIMS)), d)
        else:
            kids = [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]
            if kind == "sequential":
                m = nn.Sequential(*kids)
            elif kind == "modulelist":
                m = nn.ModuleList(kids)
            elif kind == "moduledict":
                m = nn.ModuleDict({f"k{i}": c for i, c in enumerate(kids)})
            else:
                m = Custom(d, kids)
        built.append(m)
        return m

    kids = [node(1) for _ in range(draw(st.integers(1, 4)))]
    root = Custom(2, kids) if draw(st.booleans()) else nn.Sequential(*kids)
    owned = [(m, n, p) for m in root.modules() for n, p in m.named_parameters(recurse=False)]
    for _ in range(draw(st.integers(0, 2)) if owned else 0):
        (_, _, p), (m, n, q) = draw(st.sampled_from(owned)), draw(st.sampled_from(owned))
        if p.shape == q.shape:
            setattr(m, n, p)  # b.weight = a.weight
    return root


TYPES = (
    nn.Linear,
    nn.LayerNorm,
    nn.MultiheadAttention,
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    Custom,
    nn.ReLU,
    nn.Embedding,
)
PREDICATES = {  # functions of the module alone, so that FSDP1's lambda_fn can express them
    "own_params": lambda m: any(True for _ in m.parameters(recurse=False)),
    "two_children": lambda m: len(list(m.children())) == 2,
    "numel_mod3": lambda m: sum(p.numel() for p in m.parameters()) % 3 == 0,
}
SIZES = st.one_of(st.sampled_from((0, 1, 10**12)), st.integers(0, 40), st.integers(0, 300))


def _leaf_policies():
    return st.one_of(
        st.tuples(st.just("type"), st.sets(st.sampled_from(TYPES), min_size=1, max_size=3)),
        st.tuples(st.just("size"), SIZES),
        st.tuples(st.just("pred"), st.sampled_from(sorted(PREDICATES))),
    )


POLICIES = st.one_of(
    _leaf_policies(),
    st.tuples(st.just("any"), st.lists(_leaf_policies(), min_size=1, max_size=3)),
)


def fs_policy(desc):
    kind, arg = desc
    if kind == "type":
        return fs.policy.by_type(*arg)
    if kind == "size":
        return fs.policy.by_size(arg)
    if kind == "pred":
        return fs.policy.by_predicate(lambda name, m: PREDICATES[arg](m))
    return fs.policy.any_of(*map(fs_policy, arg))


def torch_policy(desc):
    kind, arg = desc
    if kind == "type":
        return ModuleWrapPolicy(arg)
    if kind == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=arg)
    if kind == "pred":
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=PREDICATES[arg])
    return functools.partial(_or_policy, policies=[torch_policy(d) for d in arg])


def _uses_size(desc):
    return desc[0] == "size" or (desc[0] == "any" and any(map(_uses_size, desc[1])))


def _check_invariants(module, groups, ignored_names):
    """The documented rules that hold whatever the policy."""
    named = dict(module.named_parameters())
    flat = [n for names in groups.values() for n in names]
    assert len(flat) == len(set(flat)), "a parameter is in two groups"
    ignored_ids = {
        id(dict(module.named_parameters(remove_duplicate=False))[n]) for n in ignored_names
    }
    assert set(flat) == {n for n, p in named.items() if id(p) not in ignored_ids}
    assert next(iter(groups)) == ""
    order = [n for n, _ in module.named_modules()]
    assert list(groups) == [n for n in order if n in groups], "groups not in depth-first order"


# ---------------------------------------------------------------------------------------------
# Property tests: funcshard.group == FSDP1 on random trees.


@settings(max_examples=500, deadline=None)
@given(module=trees(), desc=POLICIES)
def test_group_matches_fsdp1(module, desc):
    ours = fs.group(module, fs_policy(desc))
    ref, _ = fsdp1_groups(module, torch_policy(desc))
    _check_invariants(module, ours, ())
    assert ours == ref


@settings(max_examples=400, deadline=None)
@given(module=trees(), desc=POLICIES, data=st.data())
def test_group_with_ignored_matches_fsdp1(module, desc, data):
    modules = [n for n, _ in module.named_modules()][1:]
    params = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    ign_m = (
        data.draw(st.lists(st.sampled_from(modules), max_size=2, unique=True)) if modules else []
    )
    ign_p = data.draw(st.lists(st.sampled_from(params), max_size=3, unique=True)) if params else []
    as_objects = data.draw(st.booleans())
    by_name = dict(module.named_modules())
    by_pname = dict(module.named_parameters(remove_duplicate=False))
    ignored = (
        [by_name[n] for n in ign_m] + [by_pname[n] for n in ign_p] if as_objects else ign_m + ign_p
    )
    ours = fs.group(module, fs_policy(desc), ignored=ignored)
    ref, _ = fsdp1_groups(module, torch_policy(desc), ign_m, ign_p)
    ignored_names = ign_p + [f"{m}.{n}" for m in ign_m for n, _ in by_name[m].named_parameters()]
    _check_invariants(module, ours, ignored_names)
    assert ours == ref


def lm():
    torch.manual_seed(0)
    return TinyLM(layers=3)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (fs.policy.by_type(Block), ModuleWrapPolicy({Block})),
        (fs.policy.by_type(Block, nn.LayerNorm), ModuleWrapPolicy({Block, nn.LayerNorm})),
        (fs.policy.by_type(nn.Embedding), ModuleWrapPolicy({nn.Embedding})),
        *[
            (fs.policy.by_size(n), functools.partial(size_based_auto_wrap_policy, min_num_params=n))
            for n in (0, 1, 16, 100, 700, 2000, 3000, 9000, 10**12)
        ],
        (
            fs.policy.by_predicate(lambda name, m: isinstance(m, nn.Linear)),
            functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)
            ),
        ),
        (
            fs.policy.any_of(fs.policy.by_type(Block), fs.policy.by_size(500)),
            functools.partial(
                _or_policy,
                policies=[
                    ModuleWrapPolicy({Block}),
                    functools.partial(size_based_auto_wrap_policy, min_num_params=500),
                ],
            ),
        ),
    ],
)
def test_policies_on_tinylm(ours, theirs):
    model = lm()
    assert fs.group(model, ours) == fsdp1_groups(model, theirs)[0]


def nested():
    """Groups three deep: what a wrapped module reports up to its parent matters."""
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(3, 3), nn.Linear(3, 3))  # 20 + 12 + 12
    return nn.Sequential(nn.Sequential(inner, nn.Linear(3, 3)), nn.ModuleList([nn.Linear(4, 4)]))


@pytest.mark.parametrize("n", [0, 6, 12, 13, 20, 21, 24, 25, 32, 44, 56, 57, 76, 77])
def test_by_size_on_nested_groups(n):
    model = nested()
    ref = fsdp1_groups(model, functools.partial(size_based_auto_wrap_policy, min_num_params=n))
    assert fs.group(model, fs.policy.by_size(n)) == ref[0]


def test_mha_is_a_leaf_for_by_size():
    model = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Linear(8, 8))
    got = fs.group(model, fs.policy.by_size(1))
    assert (
        got
        == fsdp1_groups(model, functools.partial(size_based_auto_wrap_policy, min_num_params=1))[0]
    )
    assert "0.out_proj" not in got and "0" not in got  # neither a group nor looked into
    assert "0.in_proj_weight" in got[""]


def shared_under_two_parents():
    s = nn.Linear(4, 4)  # 20 parameters, at "0" and at "1.0"
    return nn.Sequential(s, nn.Sequential(s, nn.Linear(2, 2)))


def test_shared_module_counted_once():
    """The construct excluded from the size comparisons, spelled out.

    FSDP1 walks ``s`` twice: ``1`` claims 20 below it (remainder 6, not wrapped) and the root
    claims 40 of its 26 parameters (remainder -14). funcshard walks ``s`` once, from ``0``; at
    ``1.0`` it reports what it claimed the first time, so the groups are FSDP1's.
    """
    model = shared_under_two_parents()
    by_size_20 = functools.partial(size_based_auto_wrap_policy, min_num_params=20)
    ref, visits = fsdp1_groups(model, by_size_20)
    assert visits["0"] == 2
    assert ref == {"": ["1.1.weight", "1.1.bias"], "0": ["0.weight", "0.bias"]}
    assert fs.group(model, fs.policy.by_size(20)) == ref


def test_by_size_shared_module_in_a_group_is_not_unassigned():
    # by_size: "modules with at least min_params parameters not already in a group below them".
    # "1" has 6 such parameters ("1.0" is the group "0"), yet becomes a group with by_size(20).
    assert "1" not in fs.group(shared_under_two_parents(), fs.policy.by_size(20))


# ---------------------------------------------------------------------------------------------
# The documented rules, explicitly.


def test_root_is_always_a_group():
    model = lm()
    names = list(dict(model.named_parameters()))
    assert fs.group(model) == {"": names}
    assert fs.group(model, fs.policy.by_size(10**12)) == {"": names}
    assert fs.group(model, fs.policy.by_type(nn.Conv1d)) == {"": names}
    got = fs.group(model, fs.policy.by_type(TinyLM))
    assert got == {"": names}


def test_every_parameter_exactly_once_in_depth_first_order():
    model = lm()
    got = fs.group(model, fs.policy.by_type(Block, nn.Linear))
    _check_invariants(model, got, ())
    assert list(got)[:3] == ["", "blocks.0", "blocks.0.attn.qkv"]
    assert got["blocks.0"] == [
        "blocks.0.ln1.weight",
        "blocks.0.ln1.bias",
        "blocks.0.ln2.weight",
        "blocks.0.ln2.bias",
    ]


def test_tied_embedding_head_once_under_first_name():
    model = lm()
    for policy in (None, fs.policy.by_type(nn.Linear), fs.policy.by_type(nn.Embedding)):
        got = fs.group(model, policy)
        flat = [n for names in got.values() for n in names]
        assert "embed.weight" in flat and "head.weight" not in flat
    got = fs.group(model, fs.policy.by_type(nn.Linear))
    assert got["head"] == []  # its weight is the embedding's, which the root reached first


def test_shared_parameter_goes_to_first_group_in_modules_order():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    got = fs.group(model, fs.policy.by_type(nn.Linear))
    assert got == {"": [], "0": ["0.weight", "0.bias"], "1": ["1.bias"]}
    # Parent before child: the root reaches "1.weight" (its own), though its first name lies
    # inside group "0.0".
    inner, outer = nn.Linear(3, 3), nn.Linear(3, 3)
    outer.weight = inner.weight
    model = nn.Sequential(nn.Sequential(inner), outer)
    got = fs.group(model, fs.policy.by_type(nn.Sequential))
    assert got == {"": ["0.0.weight", "1.bias"], "0": ["0.0.bias"]}
    assert got == fsdp1_groups(model, ModuleWrapPolicy({nn.Sequential}))[0]


def test_group_after_to_meta_remembers_ties():
    """After extract, ``to("meta")`` unties the embedding and head; group still sees one."""
    model = lm()
    policy = fs.policy.by_type(Block, nn.Linear)
    fs.extract(model)
    before = fs.group(model, policy)
    model.to("meta")
    assert model.head.weight is not model.embed.weight
    assert fs.group(model, policy) == before


def test_by_names():
    model = lm()
    names = ["blocks.1", "blocks.0.mlp", "norm"]
    got = fs.group(model, fs.policy.by_names(names))
    assert got == fs.group(model, fs.policy.by_predicate(lambda n, m: n in names))
    assert fs.group(model, fs.policy.by_names("norm")) == fs.group(
        model, fs.policy.by_names(["norm"])
    )
    with pytest.raises(ValueError, match=r"blocks\.7"):
        fs.group(model, fs.policy.by_names(["blocks.0", "blocks.7"]))
    with pytest.raises(ValueError, match="nope"):
        fs.group(model, fs.policy.any_of(fs.policy.by_type(Block), fs.policy.by_names("nope")))


@pytest.mark.parametrize("bad", [(int,), (), (nn.Linear(2, 2),), ("Linear",)])
def test_by_type_rejects_non_modules(bad):
    with pytest.raises(TypeError, match="by_type"):
        fs.policy.by_type(*bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "10"])
def test_by_size_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="by_size"):
        fs.policy.by_size(bad)


def test_any_of_rejects_non_policies():
    with pytest.raises(TypeError, match="any_of"):
        fs.policy.any_of(ModuleWrapPolicy({nn.Linear}))


def test_ignored_fqns_and_objects_agree():
    model = lm()
    policy = fs.policy.by_type(Block)
    by_fqn = fs.group(model, policy, ignored=["blocks.1", "pos", "head.weight"])
    by_obj = fs.group(model, policy, ignored=[model.blocks[1], model.pos, model.embed.weight])
    assert by_fqn == by_obj
    assert "blocks.1" not in by_fqn  # an ignored module is no group
    flat = [n for names in by_fqn.values() for n in names]
    assert not any(n.startswith("blocks.1.") or n in ("pos", "embed.weight") for n in flat)
    assert (
        by_fqn
        == fsdp1_groups(model, ModuleWrapPolicy({Block}), ["blocks.1"], ["pos", "head.weight"])[0]
    )


@pytest.mark.parametrize(
    ("item", "shown"),
    [
        ("blocks.9", "blocks.9"),
        ("embed.weigth", "embed.weigth"),
        (nn.Linear(2, 2), "Linear"),
        (nn.Parameter(torch.zeros(3)), "Parameter"),
    ],
)
def test_ignored_entry_not_in_module(item, shown):
    with pytest.raises(ValueError, match=shown):
        fs.group(lm(), fs.policy.by_type(Block), ignored=[item])


def test_shared_child_of_ignored_module_is_not_a_group():
    c = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), c), nn.Sequential(c))
    ref = fsdp1_groups(model, ModuleWrapPolicy({nn.Linear}), ["0"])[0]
    assert ref == {"": []}
    assert fs.group(model, fs.policy.by_type(nn.Linear), ignored=[model[0]]) == ref


# ---------------------------------------------------------------------------------------------
# Already wrapped by FSDP2: needs a process group.


def group_of_fully_sharded():
    from torch.distributed.fsdp import fully_shard

    model = lm()
    fully_shard(model.blocks[1], mesh=mesh(2))
    try:
        fs.group(model, fs.policy.by_type(Block))
    except ValueError as e:
        return str(e)
    return None


def test_already_fully_sharded_is_an_error(world2):
    for msg in world2.run(group_of_fully_sharded):
        assert msg is not None and "'blocks.1'" in msg and "fully_shard" in msg
