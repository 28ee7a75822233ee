"""The plan lowered into what the executor runs (``funcshard/_execution/_program.py``), checked
by hand against a printed plan, and the group state machine of the executor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard._execution._program import Cursor, lower
from funcshard._runtime._mode import Mode


def _plan(**kw) -> fs.Plan:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    return fs.plan(model, fs.policy.by_type(nn.Linear), **kw)


def _ops(steps) -> list[str]:
    return [f"{s.op} {s.group}" for s in steps]


def test_forward_lowered_by_hand():
    """The forward steps between compute steps, as the printed plan lists them."""
    program = lower(_plan(), Mode.EAGER, frozenset())
    fwd = program.forward
    assert fwd.runs == ("0", "1", "2")
    assert [_ops(b) for b in fwd.before] == [
        ["all_gather 0", "wait 0", "all_gather 1"],
        ["free 0", "wait 1", "all_gather 2"],
        ["free 1", "wait 2"],
    ]
    assert _ops(fwd.rest) == ["free 2"]
    assert fwd.arm == ("1", "2", None)  # the next group's gather is armed when a run starts


def test_backward_frees_are_autograds_unless_frozen():
    """Backward: a group's free is its post-backward callback's (not the executor's) unless the
    group is frozen; reduce-scatters are autograd's on every path."""
    plan = _plan()
    back = lower(plan, Mode.EAGER, frozenset()).backward
    assert back.runs == ("2", "1", "0")
    every = [s for b in back.before for s in b] + list(back.rest)
    assert {s.op for s in every} == {"all_gather", "wait"}
    frozen = lower(plan, Mode.EAGER, frozenset({"1"})).backward
    frees = [s.group for b in frozen.before for s in b if s.op == "free"]
    frees += [s.group for s in frozen.rest if s.op == "free"]
    assert frees == ["1"]
    assert any(s.op == "reduce_scatter" for s in plan.backward)  # in the plan, not lowered


@pytest.mark.parametrize("mode", [Mode.SYNCHRONOUS, Mode.ANOMALY, Mode.TRACED_SYNCHRONOUS])
def test_nothing_freed_where_groups_cannot_be_refilled(mode):
    program = lower(_plan(), mode, frozenset({"0", "1", "2"}))
    for phase in (program.forward, program.backward):
        steps = [s for b in phase.before for s in b] + list(phase.rest)
        assert "free" not in {s.op for s in steps}, mode


def test_traced_frees_in_forward_only():
    program = lower(_plan(), Mode.TRACED, frozenset())
    assert _ops(program.forward.rest) == ["free 2"]
    assert not [s for b in program.backward.before for s in b if s.op == "free"]


def test_cursor_steps_over_skipped_runs():
    """A run the module skips: its steps still run (every rank issues the same collectives)."""
    cursor = Cursor(lower(_plan(), Mode.EAGER, frozenset()).forward)
    assert cursor.current() is None
    assert cursor.find("2") == 2
    runs = cursor.advance(2)
    assert [group for _, group in runs] == ["0", "1", "2"]  # 0 and 1 skipped, then 2
    assert [_ops(steps) for steps, _ in runs] == [
        ["all_gather 0", "wait 0", "all_gather 1"],
        ["free 0", "wait 1", "all_gather 2"],
        ["free 1", "wait 2"],
    ]
    assert cursor.current() == "2" and cursor.find("0") is None
    assert [(_ops(steps), group) for steps, group in cursor.rest()] == [(["free 2"], None)]
    assert cursor.rest() == []


def test_modes_from_torch_state():
    assert Mode.now() is Mode.EAGER
    with pytest.warns(UserWarning, match="Anomaly"), torch.autograd.detect_anomaly(False):
        assert Mode.now() is Mode.ANOMALY
    seen = []

    def f(x):
        seen.append(Mode.now())
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    assert seen == [Mode.SYNCHRONOUS]
    assert Mode.EAGER.asynchronous and Mode.EAGER.frees and Mode.EAGER.plain
    assert not Mode.ANOMALY.asynchronous and not Mode.ANOMALY.frees and Mode.ANOMALY.plain
    assert Mode.TRACED.frees and Mode.TRACED.traced and not Mode.TRACED.plain


def test_group_states_move_only_as_allowed():
    """Every legal move of [Note: a group's states], and a wrong one raising at once."""
    from funcshard._execution._schedule import State, _Group

    group = _Group.__new__(_Group)
    group.name, group.state = "blocks.0", State.SHARDED
    for to in (State.IN_FLIGHT, State.UNSHARDED, State.FREED, State.IN_FLIGHT, State.FREED):
        group._move(to)
        assert group.state is to
    with pytest.raises(RuntimeError, match=r"'blocks.0' cannot go from freed to unsharded"):
        group._move(State.UNSHARDED)
    group.state = State.SHARDED
    with pytest.raises(RuntimeError, match="from sharded to freed"):
        group._move(State.FREED)
