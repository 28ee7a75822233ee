"""torch.utils.checkpoint inside the module (non-reentrant: Hugging Face's gradient
checkpointing, torchtitan's checkpoint_wrapper) on every funcshard path: the recompute sees the
call's parameters, with the module on meta or holding stale weights, in fp32 and bf16, with and
without reshard after forward, and a resharded group is gathered once in backward."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import funcshard as fs

from _comm import Collectives
from _mesh import mesh
from _models import Block, TinyLM, lm_loss, make, reference_step, tokens


class CheckpointedBlock(Block):
    """A block whose whole forward is one checkpoint region (as HF's decoder layers)."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


class ReentrantBlock(Block):
    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=True)


def _model(style: str, layers: int = 2) -> TinyLM:
    """TinyLM whose blocks checkpoint themselves (``inner``), are wrapped by torchtitan's
    ``checkpoint_wrapper`` (``wrapper``), or checkpoint only their MLP (``partial``)."""
    model = make(layers=layers, batchnorm=False)
    for i, block in enumerate(model.blocks):
        if style == "inner":
            new = CheckpointedBlock(16, 2)
            new.load_state_dict(block.state_dict())
            model.blocks[i] = new
        elif style == "wrapper":
            model.blocks[i] = checkpoint_wrapper(block)
        elif style == "partial":
            block.mlp = checkpoint_wrapper(block.mlp)
        elif style == "reentrant":
            new = ReentrantBlock(16, 2)
            new.load_state_dict(block.state_dict())
            model.blocks[i] = new
    return model


def _moved(model, sharded, scale: float = 1.5):
    """The shards moved away from the module's own weights (as after an optimizer step), and an
    unsharded reference model holding the moved values."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for v in sharded.values():
            v.mul_(scale)
        for p in ref.parameters():
            p.mul_(scale)
    return ref


def _max_err(grads, ref_grads, names) -> float:
    return max((grads[k].full_tensor().float() - ref_grads[names[k]]).abs().max().item()
               for k in grads)  # fmt: skip


def paths(style: str, meta: bool, bf16: bool):
    """Gradients of every path against the unsharded reference on the moved weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(style)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(world))
    ref = _moved(model, sharded)
    if meta:
        model.to("meta")
    names = {k: k for k in params}
    batches = [tokens(r) for r in range(world)]
    ref_loss, ref_grads, _ = reference_step(ref, batches)
    ref_grads = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in ref_grads.items()}
    names = {k: k.replace("._checkpoint_wrapped_module", "") for k in params}
    dtype = torch.bfloat16 if bf16 else None
    reduce_dtype = torch.float32 if bf16 else None
    batch = tokens(rank)
    out = {}
    policy = fs.policy.by_type(Block, type(model.blocks[0]))
    for reshard in (True, False):
        plan = fs.plan(
            model,
            policy,
            reshard_after_forward=reshard,
            param_dtype=dtype,
            reduce_dtype=reduce_dtype,
        )
        apply = fs.schedule(model, plan)
        loss_fn = lambda p, apply=apply: lm_loss(apply(p, batch, buffers=buffers), batch)
        loss, grads = fs.value_and_grad(loss_fn)(sharded)
        out[f"schedule reshard={reshard}"] = (loss.item(), _max_err(grads, ref_grads, names))
    full = fs.unshard(sharded, param_dtype=dtype)
    full = {k: v.detach().requires_grad_() for k, v in full.items()}
    loss = lm_loss(fs.functional_call(model, (full, buffers), (batch,)), batch)
    fulls = dict(zip(full, torch.autograd.grad(loss, list(full.values())), strict=True))
    reduced = fs.reduce(fulls, sharded, reduce_dtype=reduce_dtype)
    out["unshard + functional_call + reduce"] = (loss.item(), _max_err(reduced, ref_grads, names))
    loss, grads = fs.value_and_grad(
        lambda p: lm_loss(fs.functional_call(model, (fs.unshard(p), buffers), (batch,)), batch)
    )(sharded)
    out["value_and_grad over unshard"] = (loss.item(), _max_err(grads, ref_grads, names))
    return ref_loss.item(), out


@pytest.mark.parametrize("style", ["inner", "wrapper", "partial"])
@pytest.mark.parametrize("meta", [True, False], ids=["meta", "stale"])
def test_checkpointed_module_matches_unsharded(world2, style, meta):
    results = world2.run(paths, style, meta, False)
    for _, out in results:
        for path, (_, err) in out.items():
            assert err < 1e-5, (path, err)
    ref_loss = results[0][0]
    for path in results[0][1]:  # the mean of the ranks' losses is the reference loss
        mean = sum(out[path][0] for _, out in results) / len(results)
        assert abs(mean - ref_loss) < 1e-5, path


def test_checkpointed_module_bf16_with_fp32_reductions(world2):
    for _, out in world2.run(paths, "inner", True, True):
        for path, (_, err) in out.items():
            assert err < 0.05, (path, err)  # bf16 parameters: the reference is fp32


def gathers(style: str, reshard: bool):
    """All-gathers in forward and in backward of one scheduled step."""
    model = _model(style, layers=3)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    plan = fs.plan(model, fs.policy.by_type(Block, type(model.blocks[0])),
                   reshard_after_forward=reshard)  # fmt: skip
    apply = fs.schedule(model, plan)
    batch = tokens(dist.get_rank())
    with Collectives() as fwd:  # CommDebugMode's module tracker fails on recomputes
        loss = lm_loss(apply(sharded, batch, buffers=buffers), batch)
    with Collectives() as bwd:
        torch.autograd.grad(loss, list(sharded.values()))
    return fwd.count("all_gather"), bwd.count("all_gather"), len(plan.groups)


@pytest.mark.parametrize("style", ["none", "inner", "partial"])
def test_recompute_reuses_the_backward_regather(world2, style):
    """One all-gather per resharded group in backward, as without checkpointing (FSDP2 + AC)."""
    for reshard in (True, False):
        fwd, bwd, groups = world2.run(gathers, style, reshard)[0]
        assert fwd == groups
        assert bwd == (groups - 1 if reshard else 0)  # the root group stays unsharded


def reentrant_error():
    model = _model("reentrant")
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
    batch = tokens(dist.get_rank())
    errors = []
    for run in (
        lambda: apply(sharded, batch, buffers=buffers),
        lambda: fs.functional_call(model, (fs.unshard(sharded), buffers), (batch,)),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's own use_reentrant warnings
                run()
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def test_reentrant_checkpoint_is_refused_clearly(world2):
    for errors in world2.run(reentrant_error):
        assert len(errors) == 2
        assert all("use_reentrant=False" in e for e in errors)


def live_tensors(steps: int = 12, warmup: int = 3):
    model = _model("inner")
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    model.to("meta")
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
    live = []
    for step in range(steps):
        batch = tokens(dist.get_rank(), step=step)
        loss_fn = lambda p, t: lm_loss(apply(p, t, buffers=buffers), t)
        _, grads = fs.value_and_grad(loss_fn)(sharded, batch)
        with torch.no_grad():
            for k in sharded:
                sharded[k] -= 0.01 * grads[k]
        del grads
        if step in (warmup - 1, steps - 1):
            gc.collect()
            live.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    return live


def test_checkpointed_training_does_not_leak(world2):
    for before, after in world2.run(live_tensors):
        assert after <= before  # fewer: earlier tests' objects the pool freed meanwhile


def test_private_torch_apis_still_behave():
    """What funcshard/_trees/_activation_checkpoint.py relies on: the innermost saved-tensor hooks
    of a non-reentrant checkpoint region hold its frame, whose ``recompute_fn`` is what the
    recompute calls; ``_reparametrize_module`` swaps and restores. Fails on a torch upgrade that
    changes them."""
    from funcshard._trees._activation_checkpoint import bind, current_frame, reparametrized

    seen, calls = [], []

    def region(x):
        seen.append(current_frame())
        return (x * w).sin()

    w = torch.randn(3, requires_grad=True)
    assert current_frame() is None
    out = checkpoint(region, torch.randn(3, requires_grad=True), use_reentrant=False)
    (frame,) = seen
    assert frame is not None and callable(frame.recompute_fn)
    bind(frame, lambda: _Counting(calls))
    out.sum().backward()
    assert calls == ["enter"] and seen[1] is None  # the recompute ran bound (not in a region)
    lin = torch.nn.Linear(2, 2)
    new = torch.zeros(2, 2)
    with reparametrized(lin, {"weight": new}):
        assert lin.weight is new
    assert lin.weight is not new


class _Counting:
    def __init__(self, calls):
        self.calls = calls

    def __enter__(self):
        self.calls.append("enter")

    def __exit__(self, *exc):
        return False
