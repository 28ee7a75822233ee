"""``reshard_after_forward=N``: a ``1/N`` slice kept after forward, gathered again in backward
within sub-groups of ``N`` ranks. Against FSDP2's ``fully_shard(..., reshard_after_forward=N)``
(loss, gradients, and every collective's group size and bytes), the unsharded model, and the
kept slice's size."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard._execution import _schedule

from _comm import KINDS
from _mesh import mesh
from _models import Block, lm_loss, make, reference_step, tokens


class _Sizes(TorchDispatchMode):
    """``{(kind, ranks of its group): [bytes of each]}`` of every collective issued: the
    all-gather's output, the reduce-scatter's input, the all-reduce's tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, int], list[int]] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = KINDS.get(func.overloadpacket.__name__)
        if kind is not None and func.namespace in ("_c10d_functional", "c10d"):
            if func.namespace == "c10d":  # (output, input, group, ...) / ([tensors], group, ...)
                group = next(a for a in args if isinstance(a, torch.ScriptObject))
                ranks = dist.ProcessGroup.unbox(group).size()
                buffer = args[0][0] if isinstance(args[0], list) else args[0]
                if kind == "reduce_scatter":
                    buffer = args[1]
            else:  # (input, [reduce op,] group size, group name)
                ranks = dist.distributed_c10d._resolve_process_group(args[-1]).size()
                buffer = args[0]
                if kind == "all_gather":
                    buffer = buffer.new_empty(buffer.numel() * ranks)
            self.seen[(kind, ranks)].append(buffer.numel() * buffer.element_size())
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, tuple[int, int]]:
        """``{"kind over R ranks": (count, bytes)}``."""
        return {f"{k} over {r}": (len(v), sum(v)) for (k, r), v in sorted(self.seen.items())}


def _with_root(plan: fs.Plan, value) -> fs.Plan:
    groups = tuple(
        dataclasses.replace(g, reshard_after_forward=value) if g.name == "" else g
        for g in plan.groups
    )
    return plan.replace(groups=groups)


def int_vs_fsdp2(n: int, shape: tuple[int, ...] | None = None, recompute=None):
    """One step of fs.schedule and of FSDP2 (each block and the root with
    ``reshard_after_forward=n``) on a mesh of ``shape`` (default: 1-D, every rank; 2-D is
    HSDP); the unsharded model as well."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = mesh(*(shape or (world,)))
    ref = make(layers=3)
    for block in ref.blocks:
        fully_shard(block, mesh=m, reshard_after_forward=n)
    fully_shard(ref, mesh=m, reshard_after_forward=n)
    model = make(layers=3)
    full_ref = make(layers=3)
    params, buffers = fs.extract(model)
    buffers = {k: v.clone() for k, v in buffers.items()}
    sharded = fs.shard(params, m)
    plan = fs.plan(model, fs.policy.by_type(Block), reshard_after_forward=n, recompute=recompute)
    plan = _with_root(plan, n)
    model.to("meta")
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    with _Sizes() as theirs:
        ref_loss = lm_loss(ref(batch), batch)
        ref_loss.backward()
    with _Sizes() as ours:
        loss = lm_loss(apply(sharded, batch, buffers=buffers), batch)
        grads = torch.autograd.grad(loss, list(sharded.values()))
    grads = dict(zip(sharded, grads, strict=True))
    ref_params = dict(ref.named_parameters())
    vs_fsdp2 = max((grads[k] - ref_params[k].grad).abs().max().item() for k in grads)
    batches = [tokens(r) for r in range(world)]
    mean_loss, mean_grads, _ = reference_step(full_ref, batches)
    full = {k: g.full_tensor() for k, g in grads.items()}
    vs_full = max((full[k] - mean_grads[k]).abs().max().item() for k in full)
    losses = torch.stack([loss.detach()])
    dist.all_reduce(losses)
    return (
        abs(loss.item() - ref_loss.item()),
        vs_fsdp2,
        abs(losses.item() / world - mean_loss.item()),
        vs_full,
        ours.totals(),
        theirs.totals(),
    )


def _check_int_vs_fsdp2(results, world: int, n: int) -> None:
    for loss_err, vs_fsdp2, mean_err, vs_full, ours, theirs in results:
        assert loss_err < 1e-5 and vs_fsdp2 < 1e-5, (loss_err, vs_fsdp2)
        assert mean_err < 1e-5 and vs_full < 1e-5, (mean_err, vs_full)
        assert ours == theirs, (ours, theirs)
        # backward re-gathers (4 groups, root included) over n ranks, as many as forward's
        assert ours[f"all_gather over {n}"] == ours[f"all_gather over {world}"]
        assert ours[f"reduce_scatter over {world}"][0] == 4


def test_int_matches_fsdp2_4_ranks(worlds):
    _check_int_vs_fsdp2(worlds(4).run(int_vs_fsdp2, 2), 4, 2)


def test_int_with_recompute_matches_fsdp2(worlds):
    """A group that recomputes its forward is gathered again (within its sub-group) once."""
    _check_int_vs_fsdp2(worlds(4).run(int_vs_fsdp2, 2, None, True), 4, 2)


@pytest.mark.parametrize("n", [2, 4])
def test_int_matches_fsdp2_8_ranks(worlds, n):
    _check_int_vs_fsdp2(worlds(8).run(int_vs_fsdp2, n), 8, n)


def test_int_hsdp_matches_fsdp2_8_ranks(worlds):
    """HSDP (2 replicas of 4 shards): sub-groups of 2 within each replica's shard dim."""
    results = worlds(8).run(int_vs_fsdp2, 2, (2, 4))
    _check_int_vs_fsdp2(results, 4, 2)
    assert all(r[4]["all_reduce over 2"][0] == 4 for r in results)


def kept_after_forward(n: int):
    """After forward, each group's full tensors hold no storage and its kept slices are
    ``1/n`` of its padded full bytes; after backward nothing is kept."""
    world = dist.get_world_size()
    m = mesh(world)
    model = make(layers=2)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, m)
    plan = fs.plan(model, fs.policy.by_type(Block), reshard_after_forward=n)
    model.to("meta")
    apply = fs.schedule(model, plan)
    runs = []
    init = _schedule._Run.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        runs.append(self)

    _schedule._Run.__init__ = record
    try:
        loss = lm_loss(apply(sharded, tokens(dist.get_rank()), buffers=buffers), tokens(0))
        with torch.no_grad():  # no backward to come: nothing kept
            apply(sharded, tokens(dist.get_rank()), buffers=buffers)
    finally:
        _schedule._Run.__init__ = init
    run, inference = runs
    assert all(state.kept is None for state in inference.groups.values())
    out = {}
    for g in plan.groups:
        state = run.groups[g.name]
        padded = sum(
            -(-params[p].shape[0] // world) * world * params[p][0].numel() for p in g.params
        )
        kept = sum(t.numel() for t in state.kept or ())
        live = sum(s.nbytes() for s, _ in state.storages)
        out[g.name] = (padded, kept, live, state.state.value)
    loss.backward()
    after = {g.name: (run.groups[g.name].kept, run.groups[g.name].state.value) for g in plan.groups}
    return out, after


def test_kept_slice_is_one_nth(worlds):
    for out, after in worlds(4).run(kept_after_forward, 2):
        for name, (padded, kept, live, state) in out.items():
            if name == "":  # the root stays unsharded (see [Note: the root group])
                assert kept == 0 and live == padded * 4 and state == "unsharded", out
            else:
                assert kept * 2 == padded and live == 0 and state == "freed", out
        assert all(k is None and s == "freed" for k, s in after.values()), after


def _tiny_plan(value) -> fs.Plan:
    return fs.plan(make(layers=2), fs.policy.by_type(Block), reshard_after_forward=value)


def test_plan_prints_and_round_trips_an_int():
    plan = _tiny_plan(2)
    assert [g.reshard_after_forward for g in plan.groups] == [False, 2, 2]
    text = str(plan)
    assert "blocks.0  " in text and "resharded to 2 ranks after forward" in text
    assert "    7  reshard        blocks.0" in text
    forward_ops = [(s.op, s.group) for s in plan.forward]
    assert ("reshard", "blocks.1") in forward_ops and ("free", "blocks.1") not in forward_ops
    # resharded groups are gathered again in backward, as with True
    assert [s for s in plan.backward if s.op == "all_gather"] == [
        s for s in _tiny_plan(True).backward if s.op == "all_gather"
    ]
    saved = plan.to_json()
    assert [g["reshard_after_forward"] for g in json.loads(saved)["groups"]] == [False, 2, 2]
    back = fs.Plan.from_json(saved)
    assert back == plan and str(back) == text
    assert back.groups[1].reshard_after_forward == 2 and back != _tiny_plan(True)


def test_int_one_is_false_and_bad_values_are_named():
    assert _tiny_plan(1).forward == _tiny_plan(False).forward
    assert "kept unsharded after forward" in str(_tiny_plan(1))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=r"group 'blocks\.0' has reshard_after_forward"):
            _tiny_plan(bad)


def not_a_divisor():
    m = mesh(dist.get_world_size())
    model = make(layers=2)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, m)
    apply = fs.schedule(model, _tiny_plan(3))
    try:
        apply(sharded, tokens(0), buffers=buffers)
    except ValueError as e:
        return str(e)
    return None


def test_int_not_dividing_the_shard_dim_is_named(worlds):
    for message in worlds(4).run(not_a_divisor):
        assert "group 'blocks.0'" in message and "reshard_after_forward=3" in message
        assert "does not divide the size 4" in message and "divisor of 4" in message


def test_under_torch_compile_int_is_a_full_reshard(worlds):
    """Traced, a ``reshard`` step frees as ``free`` does: the compiled backward gathers each
    block again over the whole dim, with eager's values (see [Note: reshard to a smaller
    mesh])."""
    from test_compile import schedule_follows_plan

    for same, events, planned, kept_out in worlds(4).run(schedule_follows_plan, 2):
        assert same, (events, planned)
        assert planned.count(("all_gather", "blocks.0")) == 2
        assert all(kept_out.values()), kept_out


def under_torch_func(n: int):
    """torch.func.grad_and_value over an int plan: nothing is freed (see [Note: reshard
    after forward without saved-tensor tricks inside torch.func]), so no sub-group gathers;
    the loss and gradients of plain autograd."""
    world = dist.get_world_size()
    model = make(layers=2, batchnorm=False)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    plan = fs.plan(model, fs.policy.by_type(Block), reshard_after_forward=n)
    model.to("meta")
    apply = fs.schedule(model, plan)
    batch = tokens(dist.get_rank())
    loss_fn = lambda p: lm_loss(apply(p, batch, buffers=buffers), batch)
    with _Sizes() as plain:
        loss = loss_fn(sharded)
        grads = torch.autograd.grad(loss, list(sharded.values()))
    with _Sizes() as func:
        func_grads, value = torch.func.grad_and_value(loss_fn)(fs.to_local(sharded))
    func_grads = fs.from_local(func_grads)
    err = max((g - func_grads[k]).abs().max().item() for k, g in zip(sharded, grads, strict=True))
    return abs(value.item() - loss.item()), err, plain.totals(), func.totals()


def test_under_torch_func_int_keeps_everything(worlds):
    for loss_err, grad_err, plain, func in worlds(4).run(under_torch_func, 2):
        assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
        assert plain["all_gather over 2"][0] == 2, plain  # the blocks, again in backward
        assert set(func) == {"all_gather over 4", "reduce_scatter over 4"}, func
        assert func["all_gather over 4"] == plain["all_gather over 4"], (plain, func)


def test_merge_groups_keeps_the_int():
    """Groups merge only with neighbours resharded alike: 2 with 2, not 1 with True (equal
    as Python values)."""
    model = make(layers=2)
    plan = _tiny_plan(2)
    merged = fs.merge_groups(plan, model, 10**9)
    assert [(g.name, g.reshard_after_forward) for g in merged.groups] == [
        ("", False),
        ("blocks.0..blocks.1", 2),
    ]
    values = {"": False, "blocks.0": 1, "blocks.1": True}
    mixed = plan.replace(
        groups=tuple(
            dataclasses.replace(g, reshard_after_forward=values[g.name]) for g in plan.groups
        )
    )
    assert len(fs.merge_groups(mixed, model, 10**9).groups) == 3
