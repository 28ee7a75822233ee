"""Plans are data: printed, compared, edited, saved as JSON, recorded from a dry run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs

from _models import Block, TinyLM


def _plan(**kw):
    torch.manual_seed(0)
    return fs.plan(TinyLM(layers=3), fs.policy.by_type(Block), **kw)


def test_default_order_and_groups():
    p = _plan()
    assert [g.name for g in p.groups] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert p.order == ("", "blocks.0", "blocks.1", "blocks.2", "")  # root runs again at the end
    assert p.backward_order == tuple(reversed(p.order))
    root = p.groups[0]
    assert not root.reshard_after_forward and all(g.reshard_after_forward for g in p.groups[1:])
    assert "head.weight" not in root.params and "embed.weight" in root.params  # tied: once


def _count(steps, op, group=None):
    return sum(1 for s in steps if s.op == op and (group is None or s.group == group))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("reshard", [True, False])
def test_steps_match_fsdp2_communication(prefetch, reshard):
    p = _plan(prefetch=prefetch, backward_prefetch=prefetch, reshard_after_forward=reshard)
    gathers = _count(p.forward, "all_gather") + _count(p.backward, "all_gather")
    blocks = len(p.groups) - 1
    assert gathers == (1 + 2 * blocks if reshard else 1 + blocks)
    assert _count(p.backward, "reduce_scatter") == len(p.groups)
    # every gather is waited for before its group computes
    for steps, compute in ((p.forward, "forward"), (p.backward, "backward")):
        waited = (
            set()
            if steps is p.forward
            else {g.name for g in p.groups if not reshard or not g.reshard_after_forward}
        )
        for s in steps:
            if s.op == "wait":
                waited.add(s.group)
            if s.op == compute:
                assert s.group in waited, (s, steps)
            if s.op == "free":
                waited.discard(s.group)


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_forward_window(prefetch):
    """At most 1 + prefetch non-root groups gathered or in flight at any step."""
    p = _plan(prefetch=prefetch)
    live: set[str] = set()
    peak = 0
    for s in p.forward:
        if s.op == "all_gather":
            live.add(s.group)
        elif s.op == "free":
            live.discard(s.group)
        peak = max(peak, len(live - {""}))
    assert peak == min(1 + prefetch, len(p.groups) - 1)


def test_prefetch_is_issued_before_the_current_group_computes():
    p = _plan(prefetch=1)
    steps = [str(s).split() for s in p.forward]
    i = steps.index(["forward", "blocks.0"])
    assert ["all_gather", "blocks.1"] in steps[:i]


def test_equality_replace_and_json():
    p = _plan()
    assert p == _plan() and p != _plan(prefetch=2)
    q = p.replace(prefetch=2)
    assert q == _plan(prefetch=2) and q.forward != p.forward
    swapped = p.replace(order=("", "blocks.1", "blocks.0", "blocks.2", ""))
    assert swapped.backward_order == tuple(reversed(swapped.order))
    assert fs.Plan.from_json(p.to_json()) == p
    assert fs.Plan.from_json(swapped.to_json()) == swapped


def test_print_is_readable():
    text = str(_plan())
    assert "prefetch=1" in text and "<root>" in text and "blocks.2" in text
    assert "all_gather     blocks.0" in text and "reduce_scatter blocks.2" in text


def test_json_with_edited_steps_is_refused():
    p = _plan()
    tampered = p.to_json().replace('"free"', '"wait"', 1)
    with pytest.raises(ValueError, match="derived"):
        fs.Plan.from_json(tampered)


def test_invalid_plans():
    p = _plan()
    with pytest.raises(ValueError, match=r"names \[.blocks.9.\], which are not groups"):
        p.replace(order=("", "blocks.9"))
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        p.replace(prefetch=-1)
    with pytest.raises(ValueError, match="more than one group"):
        p.replace(groups=(*p.groups, fs.Group("x", p.groups[1].params)))


def test_recorded_order_follows_the_forward():
    class Swapped(TinyLM):
        def forward(self, tokens):  # runs block 1 before block 0
            h = self.embed(tokens)
            h = self.blocks[0](self.blocks[1](h))
            return self.head(self.norm(h))

    torch.manual_seed(0)
    model = Swapped(layers=2, batchnorm=False)
    example = torch.randint(0, 37, (2, 8))
    p = fs.plan(model, fs.policy.by_type(Block), example_args=(example,))
    assert p.order == ("", "blocks.1", "blocks.0", "")
    # nothing was computed: the dry run is on meta
    assert all(t.device.type == "cpu" for t in model.parameters())


def test_nested_groups_default_order():
    torch.manual_seed(0)
    policy = fs.policy.any_of(fs.policy.by_type(Block), fs.policy.by_names(["blocks.0.mlp"]))
    p = fs.plan(TinyLM(layers=2), policy)
    assert p.order == ("", "blocks.0", "blocks.0.mlp", "blocks.0", "blocks.1", "")


def test_dry_run_failure_says_what_to_do():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x) if x.sum().item() > 0 else x

    with pytest.raises(RuntimeError, match="order="):
        fs.plan(DataDependent(), example_args=(torch.ones(2),))


def test_empty_groups_are_dropped():
    torch.manual_seed(0)
    p = fs.plan(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)), fs.policy.by_type(nn.ReLU, nn.Linear))
    assert [g.name for g in p.groups] == ["1"]


def test_low_precision_keeps_batchnorm_in_its_own_float32_group():
    """FSDP1's rule: with a low param_dtype, each BatchNorm module is a group in
    float32, with a warning; the dtypes are part of the plan (printed, JSON)."""
    with pytest.warns(UserWarning, match=r"BatchNorm modules \['bn'\].*float32"):
        p = _plan(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    by_name = {g.name: g for g in p.groups}
    assert (by_name["bn"].param_dtype, by_name["bn"].reduce_dtype) == (torch.float32,) * 2
    assert by_name["bn"].params == ("bn.weight", "bn.bias")
    for name in ("", "blocks.0"):
        assert (by_name[name].param_dtype, by_name[name].reduce_dtype) == (
            torch.bfloat16,
            torch.float32,
        )
    bn_line = next(line for line in str(p).splitlines() if line.strip().startswith("bn "))
    assert bn_line.endswith("2 params  (param_dtype float32, reduce_dtype float32)")
    assert fs.Plan.from_json(p.to_json()) == p
    names = lambda plan: [g.name for g in plan.groups]
    assert names(_plan(param_dtype=torch.float32)) == names(_plan())  # no rule in full precision
    edited = p.replace(
        groups=tuple(g if g.name != "bn" else fs.Group("bn", g.params) for g in p.groups)
    )
    assert fs.Plan.from_json(edited.to_json()).groups[-1].param_dtype is None
