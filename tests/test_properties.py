"""Property tests over random runnable module trees (nested containers, shared modules, tied
and frozen parameters, buffers, ignored modules, odd and zero shapes) x random policies x world
sizes 1-4: grouping invariants, shard/unshard round trips bit for bit, and the scheduled apply
equal to the unsharded functional_call in value and gradient.

Hypothesis draws the model in the test process; every rank gets the same pickled model (ties
and sharing survive pickling) and checks it against its own unsharded reference.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Shard

import funcshard as fs

from _mesh import mesh

D = 5  # feature width: odd, so shards are uneven on 2 and 4 ranks and empty on some


class Affine(nn.Module):
    """A parameter and a buffer; optionally a zero-size parameter that contributes nothing."""

    def __init__(self, zero: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))
        self.register_buffer("shift", torch.randn(D))
        self.empty = nn.Parameter(torch.randn(0, D)) if zero else None

    def forward(self, x):
        y = x * self.scale + self.shift
        return y if self.empty is None else y + self.empty.sum(0)


class Residual(nn.Module):
    """``x + tanh(body(x)) * gate``: a parent with its own parameter around its children."""

    def __init__(self, kids, gate: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(*kids)
        self.gate = nn.Parameter(torch.randn(D)) if gate else None

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return x + (h if self.gate is None else h * self.gate)


class Parallel(nn.Module):
    def __init__(self, kids) -> None:
        super().__init__()
        self.branches = nn.ModuleDict({f"b{i}": k for i, k in enumerate(kids)})

    def forward(self, x):
        out = x
        for branch in self.branches.values():
            out = out + branch(x)
        return out / (1 + len(self.branches))


class Root(nn.Module):
    def __init__(self, kids) -> None:
        super().__init__()
        self.layers = nn.ModuleList(kids)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@st.composite
def models(draw):
    """``(model, ignored module fqns)``: a random runnable tree of width ``D``."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    built: list[nn.Module] = []

    def node(depth):
        if built and draw(st.integers(0, 5)) == 0:
            return draw(st.sampled_from(built))  # a shared module: runs in two places
        kinds = ["linear", "norm", "affine"] + (["residual", "parallel"] if depth < 3 else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "linear":
            m = nn.Linear(D, D, bias=draw(st.booleans()))
        elif kind == "norm":
            m = nn.LayerNorm(D, elementwise_affine=draw(st.booleans()))
        elif kind == "affine":
            m = Affine(zero=draw(st.booleans()))
        else:
            kids = [node(depth + 1) for _ in range(draw(st.integers(1, 3)))]
            m = Residual(kids, draw(st.booleans())) if kind == "residual" else Parallel(kids)
        built.append(m)
        return m

    root = Root([node(1) for _ in range(draw(st.integers(1, 3)))])
    owned = [(m, n, p) for m in root.modules() for n, p in m.named_parameters(recurse=False)]
    for _ in range(draw(st.integers(0, 2))):
        (_, _, p), (m, n, q) = draw(st.sampled_from(owned)), draw(st.sampled_from(owned))
        if p.shape == q.shape:
            setattr(m, n, p)  # tie: b.weight = a.weight
    params = [p for n, p in root.named_parameters() if not n.startswith("head.")]
    for p in draw(st.lists(st.sampled_from(params), max_size=2)) if params else ():
        p.requires_grad_(False)  # frozen (the head stays trainable: see [Note: frozen leaves])
    return root, draw(st.lists(st.sampled_from(_private_leaves(root)), max_size=1, unique=True))


def _private_leaves(root: nn.Module) -> list[str]:
    """Leaf modules used once whose parameters no other module holds: safe to ignore."""
    named = list(root.named_modules(remove_duplicate=False))
    holders: dict[int, set[int]] = {}
    for _, m in named:
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(m))
    uses = collections.Counter(id(m) for _, m in named)
    return [
        name
        for name, m in root.named_modules()
        if name
        and uses[id(m)] == 1
        and not list(m.children())
        and list(m.parameters())
        and all(holders[id(p)] == {id(m)} for p in m.parameters())
    ]


POLICIES = st.one_of(
    st.just(None),
    st.sets(st.sampled_from((nn.Linear, Affine, Residual, Parallel, nn.LayerNorm)), min_size=1),
    st.integers(0, 80),
)


def _policy(desc):
    if desc is None:
        return None
    if isinstance(desc, int):
        return fs.policy.by_size(desc)
    return fs.policy.by_type(*desc)


def check(model: nn.Module, ignored: list[str], policy_desc, dims: dict, prefetch: int, reshard):
    """On every rank: grouping invariants, round trip, and scheduled value/grad parity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = _policy(policy_desc)
    reference = copy.deepcopy(model)
    params, buffers = fs.extract(model)
    groups = fs.group(model, policy, ignored)
    ignored_params = {p for m in ignored for p in params if p.startswith(m + ".")}
    grouped = [p for ps in groups.values() for p in ps]
    assert sorted(grouped) == sorted(set(params) - ignored_params), "every parameter once"
    assert set(groups) <= {n for n, _ in model.named_modules()}, "groups are modules"

    # shard / unshard round trip, bit for bit, with a random Shard dim per parameter
    placements = lambda path, t: Shard(dims.get(path, 0) % t.dim()) if t.dim() else None
    sharded = fs.shard(params, mesh(world), placements)
    with torch.no_grad():
        back = fs.unshard(sharded)
    for k, v in params.items():
        assert torch.equal(back[k], v), f"round trip of {k}"

    # scheduled step vs the unsharded model, each rank on its own batch
    xs = [torch.randn(3, D, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    plan = fs.plan(
        model, policy, ignored=ignored, prefetch=prefetch, backward_prefetch=prefetch,
        reshard_after_forward=reshard, example_args=(xs[rank],),
    )  # fmt: skip
    tree = dict(fs.shard({k: params[k] for k in grouped}, mesh(world)))
    tree.update(
        {k: params[k].detach().requires_grad_(params[k].requires_grad) for k in ignored_params}
    )
    apply = fs.schedule(model.to("meta"), plan)
    loss, grads = fs.value_and_grad(lambda p: apply(p, xs[rank], buffers=buffers).square().mean())(
        tree
    )
    ref_losses, ref_grads = [], []
    for x in xs:
        m = copy.deepcopy(reference)
        out = m(x).square().mean()
        out.backward()
        ref_losses.append(out.detach())
        ref_grads.append({k: p.grad for k, p in m.named_parameters()})
    torch.testing.assert_close(loss, ref_losses[rank], rtol=1e-5, atol=1e-6)
    for k, g in grads.items():
        if not params[k].requires_grad:
            assert g is None, f"frozen {k} got a gradient"
            continue
        if k in ignored_params:  # not sharded: this rank's own gradient
            expected = ref_grads[rank][k]
            actual = g
        else:
            expected = sum(r[k] for r in ref_grads) / world
            actual = g.full_tensor()
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=k)
    # every collective issued was waited for: no pending tensor escaped
    assert torch._C._distributed_c10d._get_work_registry_size() == 0, "unwaited collectives"
    return True


CASES = st.tuples(models(), POLICIES, st.lists(st.integers(0, 1)), st.integers(0, 2), st.booleans())


def _run(world, case):
    (model, ignored), policy, dims, prefetch, reshard = case
    names = [k for k, _ in model.named_parameters()]
    dims = {k: d for k, d in zip(names, dims, strict=False)}
    assert world.run(check, model, ignored, policy, dims, prefetch, reshard) == [True] * world.world


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_random_models(worlds, size):
    world = worlds(size)

    @settings(  # no shrinking: each example crosses processes, and the example prints anyway
        max_examples=12,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=CASES)
    def run(case):
        _run(world, case)

    run()
