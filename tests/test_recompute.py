"""Activation checkpointing in the plan (``Group.recompute``): the plan's field, and the scheduler
recomputing those groups in backward -- the same loss and gradients as the unsharded model, the
same collectives as without recompute (one re-gather per group in backward), less memory, under
plain autograd and inside torch.func transforms, fp32 and bf16, with dropout."""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_reliability import long_run
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.func import grad, vmap

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

from _comm import counts
from _mesh import mesh
from _models import Block, lm_loss, make, reference_step, shard_of, tokens

# --- the plan ---------------------------------------------------------------------------------


def _plan(layers=4, **kw):
    return fs.plan(make(layers=layers, batchnorm=False), fs.policy.by_type(Block), **kw)


def _recomputed(plan):
    return [g.name for g in plan.groups if g.recompute]


def test_selecting_groups():
    blocks = [f"blocks.{i}" for i in range(4)]
    assert _recomputed(_plan()) == []
    assert _recomputed(_plan(recompute=True)) == blocks  # every group but the root
    assert _recomputed(_plan(recompute=1)) == blocks
    assert _recomputed(_plan(recompute=2)) == ["blocks.1", "blocks.3"]  # every other
    assert _recomputed(_plan(recompute=3)) == ["blocks.2"]
    assert _recomputed(_plan(recompute=["blocks.2", "blocks.0"])) == ["blocks.0", "blocks.2"]
    plan = _plan(recompute=True)
    assert _recomputed(plan.with_recompute(False)) == []
    assert _recomputed(plan.with_recompute("blocks.1")) == ["blocks.1"]
    assert plan.with_recompute(False) == _plan()  # only the flags changed
    assert plan.forward == _plan().forward and plan.backward == _plan().backward


def test_every_kth_follows_the_forward_order():
    reversed_order = ("", "blocks.3", "blocks.2", "blocks.1", "blocks.0", "")
    plan = _plan(order=reversed_order, recompute=2)
    assert _recomputed(plan) == ["blocks.0", "blocks.2"]  # the 2nd and 4th to run


def test_printed_and_saved():
    plan = _plan(layers=2, recompute=["blocks.1"])
    lines = str(plan).splitlines()
    assert any("blocks.1" in line and "recomputed in backward" in line for line in lines)
    assert not any("blocks.0" in line and "recomputed" in line for line in lines)
    assert fs.Plan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())  # a plan saved before the field existed
    for g in old["groups"]:
        del g["recompute"]
    assert fs.Plan.from_json(json.dumps(old)) == plan.with_recompute(False)


def test_errors():
    plan = _plan(layers=2)
    for bad in ([""], ["blocks.0", ""]):
        with pytest.raises(ValueError, match="root group '' cannot recompute"):
            plan.with_recompute(bad)
    root = plan.groups[0]
    with pytest.raises(ValueError, match="root group '' cannot recompute"):
        plan.replace(groups=(fs.Group("", root.params, recompute=True), *plan.groups[1:]))
    with pytest.raises(ValueError, match=r"\['blocks\.7'\] are not groups"):
        plan.with_recompute(["blocks.7"])
    with pytest.raises(ValueError, match="must be >= 1"):
        _plan(recompute=0)


def test_schedule_refuses_groups_that_are_not_modules_or_hold_others():
    model = make(layers=2, batchnorm=False)
    plan = fs.plan(model, fs.policy.by_type(Block))
    merged = fs.merge_groups(plan, model, 10**9)
    with pytest.raises(ValueError, match="no submodule"):
        bad = merged.replace(
            groups=tuple(fs.Group(g.name, g.params, recompute=bool(g.name)) for g in merged.groups)
        )
        fs.schedule(model, bad)
    nested = fs.plan(model, fs.policy.by_type(Block, nn.LayerNorm), recompute=["blocks.0"])
    with pytest.raises(ValueError, match=r"holds parameters of the groups \['blocks\.0\.ln1'"):
        fs.schedule(model, nested)


def test_merge_groups_keeps_recompute_groups_apart():
    model = make(layers=4, batchnorm=False)
    plan = fs.plan(model, fs.policy.by_type(Block), recompute=["blocks.1", "blocks.2"])
    merged = fs.merge_groups(plan, model, 10**9)
    assert [(g.name, g.recompute) for g in merged.groups] == [
        ("", False),
        ("blocks.0", False),
        ("blocks.1", True),
        ("blocks.2", True),
        ("blocks.3", False),
    ]


def test_private_torch_api_the_recompute_binds_with():
    """``torch.nn.utils.stateless._reparametrize_module`` (torch.func.functional_call's own
    swap, private): ``_recompute`` binds a module's parameters and buffers with it, in forward
    and in backward. Fails here first if a torch upgrade changes it."""
    from torch.nn.utils.stateless import _reparametrize_module

    lin = nn.Linear(2, 2)
    weight, bias = lin.weight, lin.bias
    w, b = torch.zeros(2, 2), torch.ones(2)
    with _reparametrize_module(lin, {"weight": w, "bias": b}):
        assert lin.weight is w and lin.bias is b
        assert torch.equal(lin(torch.ones(1, 2)), torch.ones(1, 2))
    assert lin.weight is weight and lin.bias is bias


# --- the scheduler ----------------------------------------------------------------------------


def _setup(layers=2, batchnorm=True, model=None, policy=Block, **plan_kw):
    model = make(layers=layers, batchnorm=batchnorm) if model is None else model
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(policy), **plan_kw)
    model.to("meta")  # the documented pattern: the module keeps no weights
    return model, sharded, {k: v.clone() for k, v in buffers.items()}, plan


def _err(grads, ref):
    return max(
        (g.to_local().float() - shard_of(ref[k], g)).abs().max().item()
        for k, g in grads.items()
        if g.to_local().numel()
    )


def _step(model, plan, sharded, buffers, batch, **schedule_kw):
    apply = fs.schedule(model, plan, **schedule_kw)
    with CommDebugMode() as comm, warnings.catch_warnings():
        warnings.filterwarnings("error", message="funcshard")  # the plan is followed
        loss, grads = fs.value_and_grad(
            lambda p: lm_loss(apply(p, batch, buffers=buffers).float(), batch)
        )(sharded)
    return loss, grads, counts(comm)


def parity(recompute, reshard, layers):
    """A step with recompute against the unsharded reference and against the same plan without
    recompute: loss, every gradient, and the collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup(layers=layers, reshard_after_forward=reshard)
    batch = tokens(rank)
    ours = plan.with_recompute(recompute)
    loss, grads, comm = _step(model, ours, sharded, dict(buffers), batch)
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored after the call
    plain_loss, plain, plain_comm = _step(model, plan, sharded, dict(buffers), batch)
    ref_loss, ref, _ = reference_step(make(layers=layers), [tokens(r) for r in range(world)])
    mean = loss.clone()
    dist.all_reduce(mean)
    return {
        "recomputed": len(_recomputed(ours)),
        "ref": max(_err(grads, ref), abs(mean.item() / world - ref_loss.item())),
        "plain": max(
            _err(grads, {k: v.full_tensor() for k, v in plain.items()}),
            abs(loss.item() - plain_loss.item()),
        ),
        "counts": comm,
        "plain_counts": plain_comm,
        "groups": len(plan.groups),
    }


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("recompute", [True, 2, None])
def test_recompute_matches_the_unsharded_model(world2, recompute, reshard):
    for r in world2.run(parity, recompute, reshard, 4):
        assert r["recomputed"] == {True: 4, 2: 2, None: 0}[recompute]
        assert r["ref"] < 1e-5 and r["plain"] < 1e-6, r
        g = r["groups"]
        # one all-gather per group in forward, and with reshard one re-gather per group but the
        # root in backward, which the recompute uses: FSDP2 + activation checkpointing's count
        expected = {"all_gather": 2 * g - 1 if reshard else g, "reduce_scatter": g}
        assert r["counts"] == r["plain_counts"] == expected, r


def bf16():
    """bf16 parameters, fp32 reductions: the same as without recompute, near the fp32 model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup(layers=2, batchnorm=False)
    batch = tokens(rank)
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    loss, grads, comm = _step(model, plan.with_recompute(True), sharded, buffers, batch, **kw)
    plain_loss, plain, _ = _step(model, plan, sharded, buffers, batch, **kw)
    _, ref, _ = reference_step(make(layers=2, batchnorm=False), [tokens(r) for r in range(world)])
    return {
        "dtypes": {g.dtype for g in grads.values()},
        "plain": max(
            _err(grads, {k: v.full_tensor() for k, v in plain.items()}),
            abs(loss.item() - plain_loss.item()),
        ),
        "ref": _err(grads, ref),
        "counts": comm,
    }


def test_bf16_parameters_with_fp32_reduction(world2):
    for r in world2.run(bf16):
        assert r["dtypes"] == {torch.float32}
        assert r["plain"] < 1e-6 and r["ref"] < 2e-2, r
        assert r["counts"] == {"all_gather": 5, "reduce_scatter": 3}, r


def under_torch_func():
    """torch.func.grad and vmap(grad) through a recomputing schedule, where torch.utils.checkpoint
    and saved-tensor hooks are refused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, sharded, buffers, plan = _setup(layers=2, recompute=True)
    apply = fs.schedule(model, plan)
    batch = tokens(rank)

    def loss(p, bufs, b):
        return lm_loss(apply(p, b, buffers=bufs), b)

    grads = fs.from_local(grad(loss)(fs.to_local(sharded), buffers, batch))
    _, ref, _ = reference_step(make(layers=2), [tokens(r) for r in range(world)])
    # per-example gradients (a batch of one each) under vmap, against a loop without recompute
    model_nb, sharded_nb, _, plan_nb = _setup(layers=2, batchnorm=False)
    local = fs.to_local(sharded_nb)

    def one(plan):
        apply = fs.schedule(model_nb, plan)
        return lambda p, seq: lm_loss(apply(p, seq[None]), seq[None])

    per_example = vmap(grad(one(plan_nb.with_recompute(True))), in_dims=(None, 0))(
        local, batch[:, :4]
    )
    loop = [grad(one(plan_nb))(local, seq) for seq in batch[:, :4]]
    vmap_err = max(
        (per_example[k].tensor[i] - loop[i][k].tensor).abs().max().item()
        for k in per_example
        for i in range(len(loop))
    )
    return _err(grads, ref), vmap_err


def test_recompute_under_torch_func(world2):
    for err, vmap_err in world2.run(under_torch_func):
        assert err < 1e-5 and vmap_err < 1e-5


class DropBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(self.out(self.drop(F.gelu(self.fc(x)))))


class DropNet(nn.Module):
    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.Sequential(*(DropBlock(d) for _ in range(layers)))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def dropout(mode):
    """Dropout in recomputed blocks: the recompute draws the forward's masks. Same seed, same
    gradients as without recompute, and the RNG ends where it would have."""
    torch.manual_seed(0)
    model, sharded, _, plan = _setup(model=DropNet(), policy=DropBlock)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = []
    for p in (plan.with_recompute(True), plan):
        apply = fs.schedule(model, p)
        loss = lambda s, apply=apply: apply(s, x).square().mean()
        torch.manual_seed(1234)
        if mode == "autograd":
            _, grads = fs.value_and_grad(loss)(sharded)
        else:
            grads = fs.from_local(grad(loss)(fs.to_local(sharded)))
        results.append((grads, torch.rand(1).item()))
    (ours, after), (plain, plain_after) = results
    torch.manual_seed(4321)
    different = fs.value_and_grad(lambda s: fs.schedule(model, plan)(s, x).square().mean())(
        sharded
    )[1]
    return {
        "err": _local_err(ours, plain),
        "rng_after": after == plain_after,
        "masks_matter": _local_err(ours, different),
    }


def _local_err(a, b):
    diffs = [(a[k].to_local() - b[k].to_local()).abs() for k in a]
    return max(d.max().item() for d in diffs if d.numel())


@pytest.mark.parametrize("mode", ["autograd", "torch_func"])
def test_dropout_masks_replayed(world2, mode):
    for r in world2.run(dropout, mode):
        assert r["err"] < 1e-6 and r["rng_after"], r
        assert r["masks_matter"] > 1e-3, r  # other masks would give other gradients


class Deep(nn.Module):
    """Cheap parameters, expensive activations: 6 blocks of width 16 on long sequences."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(DropBlock(16) for _ in range(layers)))

    def forward(self, x):
        return self.blocks(x)


def memory():
    torch.manual_seed(0)
    model, sharded, _, plan = _setup(model=Deep(), policy=DropBlock)
    x = torch.randn(512, 16)
    peaks = {}
    for label, p in (("plain", plan), ("recompute", plan.with_recompute(True))):
        apply = fs.schedule(model, p)
        step = lambda a=apply: fs.value_and_grad(lambda s: a(s, x).square().mean())(sharded)
        step()
        gc.collect()
        peaks[label], _ = peak_bytes(step, this_thread=True)
    activation = 512 * 16 * 4  # one block input
    return peaks, activation


def test_recompute_lowers_the_peak(world2):
    """Without recompute every block keeps its activations (about 8 block-inputs' worth each:
    two 4x-wide hidden tensors, dropout masks); with it, each keeps only its input, and one
    block's activations live at a time in backward."""
    for peaks, activation in world2.run(memory):
        assert peaks["recompute"] < 0.5 * peaks["plain"], peaks
        assert peaks["plain"] - peaks["recompute"] > 20 * activation, (peaks, activation)


def cyclic_garbage():
    """One recomputing step with Python's cycle collector off, then what only the collector
    frees: the checkpoint regions' frames (which keep their inputs), and the bytes held by the
    computed tensors among it."""
    torch.manual_seed(0)
    model, sharded, _, plan = _setup(model=Deep(), policy=DropBlock, recompute=True)
    apply = fs.schedule(model, plan)
    x = torch.randn(64, 16)

    def step():
        return fs.value_and_grad(lambda s: apply(s, x).square().mean())(sharded)

    step()
    gc.collect()
    gc.disable()
    try:
        step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        frames = sum(type(o).__name__ == "_CheckpointFrame" for o in gc.garbage)
        storages = {  # the memory they hold (a freed group's full tensors hold none)
            o.untyped_storage()._cdata: o.untyped_storage().nbytes()
            for o in gc.garbage
            if type(o) is torch.Tensor and o.grad_fn is not None
        }
        activations = sum(storages.values())
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return frames, activations


def test_recomputed_inputs_are_freed_without_the_cycle_collector(world2):
    """A region's frame keeps its inputs for the recompute: it must die with the region's
    backward, not wait for the cycle collector (a cycle through the frame kept every block's
    input alive to the end of backward, or until the collector happened to run)."""
    for frames, activations in world2.run(cyclic_garbage):
        assert frames == 0 and activations == 0, (frames, activations)


@pytest.mark.parametrize("mode", ["value_and_grad", "torch_func"])
def test_recomputing_training_does_not_leak(world2, mode):
    """The recompute's autograd nodes hold nothing of a step's state: live tensors stay flat
    over 12 steps, and no collective is left pending."""
    for warm, end in world2.run(long_run, mode, 16, 4, True):
        assert end <= warm, (warm, end)


def compiled():
    """The step with recompute under torch.compile (aot_eager) equals the eager step."""
    model, sharded, _, plan = _setup(layers=2, batchnorm=False, recompute=True)
    apply = fs.schedule(model, plan)
    batch = tokens(dist.get_rank())
    vg = fs.value_and_grad(lambda p, b: lm_loss(apply(p, b), b))
    loss, grads = vg(sharded, batch)
    c_loss, c_grads = torch.compile(vg, backend="aot_eager", fullgraph=True)(sharded, batch)
    return max(_local_err(grads, c_grads), abs(loss.item() - c_loss.item()))


def test_recompute_under_torch_compile(world2):
    assert max(world2.run(compiled)) < 1e-6


class Reaching(nn.Module):
    """A block that computes with its neighbour's weight, reached by reference."""

    def __init__(self, other: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.other = other

    def forward(self, x):
        x = self.fc(x)
        return x if self.other is None else F.linear(x, self.other[0].fc.weight)


def foreign_parameter():
    torch.manual_seed(0)
    first = Reaching()
    model = nn.Sequential(first, Reaching([first]))
    model, sharded, _, plan = _setup(model=model, policy=Reaching, recompute=["1"])
    apply = fs.schedule(model, plan)
    try:
        fs.value_and_grad(lambda s: apply(s, torch.ones(2, 4)).sum())(sharded)
    except ValueError as e:
        restored = all("forward" not in m.__dict__ for m in model.modules())
        return str(e), restored


def test_a_parameter_of_another_group_is_refused(world2):
    for message, restored in world2.run(foreign_parameter):
        assert restored  # the module's forward is its own again after the error
        assert "group '1', which recomputes in backward, used the parameters ['0.fc.weight']" in (
            message
        )
