"""FSDP2's all-gather protocol (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) in funcshard's
gathers, with a tensor subclass of our own (int8 rows and per-row scales on the wire): the same
gradients as FSDP2 (bit for bit) and the unsharded model, the same bytes gathered as FSDP2, and
the errors for subclasses that cannot be sharded or whose hooks disagree between ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

import funcshard as fs

from _checks import raises
from _comm import Collectives
from _lowp import Int8Rows, Int8Rows5, gathered_bytes, int8_mlp, int8_reference
from _mesh import mesh

_CLASSES = {"one": Int8Rows, "five": Int8Rows5}


def _fsdp2(cls, m, param_dtype, reshard=True):
    model = int8_mlp(cls)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=m, mp_policy=mp, reshard_after_forward=reshard)
    return fully_shard(model, mesh=m, mp_policy=mp)


def three_ways(form: str, mesh_shape, param_dtype=None, steps: int = 2, reshard=True):
    """funcshard (one group per linear), FSDP2 (the same groups) and the unsharded model, for
    ``steps`` SGD steps: per step, the largest gradient differences (funcshard - FSDP2,
    funcshard - unsharded), the bytes each gathered and its collectives."""
    cls = _CLASSES[form]
    rank, world = dist.get_rank(), dist.get_world_size()
    m = mesh(*mesh_shape)
    theirs_model = _fsdp2(cls, m, param_dtype, reshard)
    ref = int8_mlp(None)
    model = int8_mlp(cls)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, m)
    plan = fs.plan(model, fs.policy.by_type(nn.Linear), reshard_after_forward=reshard)
    reduce = torch.float32 if param_dtype else None
    apply = fs.schedule(model, plan, param_dtype=param_dtype, reduce_dtype=reduce)
    cast = param_dtype or torch.float32  # as FSDP2 casts the inputs
    vg = fs.value_and_grad(lambda p, x: apply(p, x.to(cast)).float().square().mean())
    torch.manual_seed(7)
    batches = torch.randn(steps, world, 4, 16)
    out = []
    for step in range(steps):
        x = batches[step, rank]
        with Collectives() as ours:
            loss, grads = vg(sharded, x)
        with Collectives() as theirs:
            theirs_model(x).float().square().mean().backward()
        dtype = param_dtype or torch.float32
        ref_losses = [
            int8_reference(ref, batches[step, r], dtype).float().square().mean()
            for r in range(world)
        ]
        (sum(ref_losses) / world).backward()
        fsdp_params = dict(theirs_model.named_parameters())
        ref_params = dict(ref.named_parameters())
        vs_fsdp2 = max(_diff(grads[k].to_local(), fsdp_params[k].grad.to_local()) for k in grads)
        vs_ref = max(_diff(grads[k].full_tensor(), ref_params[k].grad) for k in grads)
        loss_err = abs(loss.item() - ref_losses[rank].item())
        out.append((vs_fsdp2, vs_ref, gathered_bytes(ours, world), gathered_bytes(theirs, world),
                    ours.counts(), theirs.counts(), loss_err))  # fmt: skip
        with torch.no_grad():
            for k in grads:
                sharded[k] -= 0.5 * grads[k]
                fsdp_params[k] -= 0.5 * fsdp_params[k].grad
                ref_params[k] -= 0.5 * ref_params[k].grad
                fsdp_params[k].grad = ref_params[k].grad = None
    return out, [type(v.to_local()).__name__ for v in sharded.values()]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("form", ["one", "five"])
@pytest.mark.parametrize("reshard", [True, False])
def test_protocol_matches_fsdp2_and_the_unsharded_model(world2, form, reshard):
    for steps, kinds in world2.run(three_ways, form, (2,), None, 2, reshard):
        assert kinds.count(_CLASSES[form].__name__) == 3  # the shards stay subclasses
        for vs_fsdp2, vs_ref, ours, theirs, our_counts, their_counts, loss_err in steps:
            assert vs_fsdp2 == 0, steps  # the same kernels on the same values
            assert vs_ref < 1e-5 and loss_err < 1e-5, steps
            assert ours == theirs and our_counts == their_counts, steps


def test_protocol_4_ranks_hsdp_and_bf16(world4):
    for steps, _ in world4.run(three_ways, "five", (2, 2), torch.bfloat16, 1):
        for vs_fsdp2, vs_ref, ours, theirs, _, _, _ in steps:
            assert vs_fsdp2 == 0 and vs_ref < 2e-2 and ours == theirs, steps


def int8_on_one_rank():
    """At world size 1 the hooks still run (nothing is sent): the rebuilt weight is used."""
    m = mesh(1)
    model = int8_mlp(Int8Rows)
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.randn(4, 16)
    _, grads = fs.value_and_grad(lambda p: apply(p, x).square().mean())(fs.shard(params, m))
    ref = int8_mlp(None)
    int8_reference(ref, x).square().mean().backward()
    return max((grads[k].to_local() - p.grad).abs().max().item() for k, p in ref.named_parameters())


def test_protocol_at_world_size_1(world1):
    assert world1.run(int8_on_one_rank) == [0.0]


def unshard_int8():
    """fs.unshard gathers through the hooks too: the full weights are the rebuilt ones."""
    m = mesh(2)
    model = int8_mlp(Int8Rows)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, m)
    x = torch.randn(4, 16)
    vg = fs.value_and_grad(lambda p: fs.functional_call(model, fs.unshard(p), (x,)).square().mean())
    _, grads = vg(sharded)
    with Collectives() as c:
        fulls = fs.unshard(sharded)
    ref = int8_mlp(None)
    ref_loss = (
        sum(int8_reference(ref, xr).square().mean() for xr in _every_rank(x))
        / dist.get_world_size()
    )
    ref_loss.backward()
    w = ref[0].weight.detach()
    exact = torch.equal(fulls["0.weight"], int8_reference_weight(w))
    grad_err = max(
        (grads[k].full_tensor() - p.grad).abs().max().item() for k, p in ref.named_parameters()
    )
    return exact, grad_err, c.sent


def int8_reference_weight(w):
    from _lowp import dequantize, quantize

    return dequantize(*quantize(w), w.dtype)


def _every_rank(x):
    xs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    return xs


def test_unshard_uses_the_hooks(world2):
    for exact, grad_err, sent in world2.run(unshard_int8):
        assert exact and grad_err < 1e-5
        assert [(k, d) for k, d, _ in sent] == [("all_gather", torch.uint8)]


class _Sized(Int8Rows):
    """Hooks that return rank-dependent sizes."""

    def fsdp_pre_all_gather(self, mesh):
        q, scale = super().fsdp_pre_all_gather(mesh)[0]
        return (q[: q.shape[0] - dist.get_rank()], scale), None


class _Tagged(Int8Rows):
    """Hooks whose metadata differs between ranks."""

    def fsdp_pre_all_gather(self, mesh):
        return super().fsdp_pre_all_gather(mesh)[0], {"rank": dist.get_rank()}


def disagreeing(kind: str):
    cls = {"sizes": _Sized, "metadata": _Tagged}[kind]
    model = int8_mlp(cls)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(2))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.randn(4, 16)
    found = raises(
        lambda: fs.value_and_grad(lambda p: apply(p, x).sum())(sharded),
        ValueError, "'0.weight'", "fsdp_pre_all_gather", "rank 0", "rank 1",
    )  # fmt: skip
    # the ranks stay in step: a good call goes through afterwards
    good = int8_mlp(Int8Rows)
    p, _ = fs.extract(good)
    apply = fs.schedule(good, fs.plan(good, fs.policy.by_type(nn.Linear)))
    fs.value_and_grad(lambda p: apply(p, x).sum())(fs.shard(p, mesh(2)))
    return found


@pytest.mark.parametrize("kind", ["sizes", "metadata"])
def test_hooks_that_disagree_between_ranks_fail_on_every_rank(world2, kind):
    assert world2.run(disagreeing, kind) == [None, None]


def unshardable():
    cls = type("NoNewZeros", (Int8Rows,), {"skip": frozenset({torch.ops.aten.new_zeros.default})})
    w = cls(torch.randn(4, 3))
    return raises(
        lambda: fs.shard({"w": w}, mesh(2)), NotImplementedError, "'w'", "new_zeros", "NoNewZeros"
    )


def test_a_subclass_without_an_operation_the_shard_needs_is_named(world2):
    assert world2.run(unshardable) == [None, None]


def refused(kind: str):
    """What funcshard refuses for protocol parameters: a layout other than dim 0 over one mesh
    dim, and torch.func transforms (whose wrappers hide the subclass)."""
    model = int8_mlp(Int8Rows)
    params, _ = fs.extract(model)
    x = torch.randn(4, 16)
    if kind == "layout":
        sharded = fs.shard(params, mesh(2), lambda path, t: Shard(1) if t.dim() == 2 else None)
        apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
        return raises(
            lambda: fs.value_and_grad(lambda p: apply(p, x).sum())(sharded),
            NotImplementedError, "'0.weight (S(1))'", "Shard(0) on one mesh dim",
        )  # fmt: skip
    local = fs.to_local(fs.shard(params, mesh(2)))
    loss = lambda p: fs.functional_call(model, fs.unshard(p), (x,)).sum()
    return raises(
        lambda: torch.func.grad(loss)(local), NotImplementedError, "'0.weight'", "torch.func"
    )


@pytest.mark.parametrize("kind", ["layout", "torch.func"])
def test_what_is_refused_is_named(world2, kind):
    assert world2.run(refused, kind) == [None, None]


def one_rank_quantized():
    """A parameter that is a subclass on one rank and plain on the other: the per-call
    agreement names it, on every rank, before any collective."""
    model = int8_mlp(Int8Rows if dist.get_rank() == 0 else None)
    params, _ = fs.extract(model)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    x = torch.randn(4, 16)
    return raises(
        lambda: fs.value_and_grad(lambda p: apply(p, x).sum())(fs.shard(params, mesh(2))),
        ValueError, "ranks disagree at '0.weight'", "Int8Rows of torch.float32",
    )  # fmt: skip


def test_a_subclass_on_one_rank_only_is_named(world2):
    assert world2.run(one_rank_quantized) == [None, None]
