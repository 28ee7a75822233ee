"""torchao as users have it, through funcshard: QLoRA (frozen NF4 weights, LoRA adapters trained)
and float8 training (``convert_to_float8_training``, with and without float8 all-gathers), on 2
and 4 gloo ranks, against FSDP2 (the same gradients, bit for bit, and the same bytes gathered)
and the unsharded model; checkpoints that round-trip and reshard to another world size."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import funcshard as fs

from _comm import Collectives
from _lowp import LoRALinear, float8_mlp, gathered_bytes, qlora_mlp
from _mesh import mesh

pytest.importorskip("torchao")


def _models(kind: str, seed: int = 0):
    """``(model, the modules that are groups)`` of a kind of model."""
    warnings.filterwarnings("ignore", category=UserWarning)
    if kind == "qlora":
        return qlora_mlp(seed), LoRALinear
    fsdp_float8 = kind.startswith("float8_all_gather")
    return float8_mlp(fsdp_float8, bias=not kind.endswith("no_bias"), seed=seed), nn.Linear


def _inputs(kind: str, steps: int, world: int) -> torch.Tensor:
    torch.manual_seed(11)
    return torch.randn(steps, world, 8, 64 if kind == "qlora" else 32)


def three_ways(kind: str, mesh_shape, steps: int = 2, fsdp2: bool = True):
    """funcshard (a group per unit), FSDP2 (the same groups) and the unsharded model, ``steps``
    SGD steps on the trained parameters: per step, the largest gradient differences with FSDP2
    and with the unsharded model, the bytes each gathered, and each one's collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = mesh(*mesh_shape)
    ref, unit = _models(kind)
    model, _ = _models(kind)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, m)
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(unit)))
    vg = fs.value_and_grad(lambda p, x: apply(p, x).square().mean())
    theirs = None
    if fsdp2:
        theirs, _ = _models(kind)
        for sub in theirs.modules():
            if isinstance(sub, unit):
                fully_shard(sub, mesh=m)
        fully_shard(theirs, mesh=m)
    batches = _inputs(kind, steps, world)
    trained = [k for k, p in ref.named_parameters() if p.requires_grad]
    out = []
    for step in range(steps):
        with Collectives() as ours:
            _, grads = vg(sharded, batches[step, rank])
        (sum(ref(x).square().mean() for x in batches[step]) / world).backward()
        ref_params = dict(ref.named_parameters())
        vs_ref = max(_diff(grads[k].full_tensor(), ref_params[k].grad) for k in trained)
        row = {"vs_ref": vs_ref, "bytes": gathered_bytes(ours, world), "counts": ours.counts()}
        if theirs is not None:
            with Collectives() as c:
                theirs(batches[step, rank]).square().mean().backward()
            their_params = dict(theirs.named_parameters())
            row["vs_fsdp2"] = max(
                _diff(grads[k].to_local(), their_params[k].grad.to_local()) for k in trained
            )
            row["fsdp2_bytes"], row["fsdp2_counts"] = gathered_bytes(c, world), c.counts()
        out.append(row)
        with torch.no_grad():
            for k in trained:
                sharded[k] -= 0.1 * grads[k]
                ref_params[k] -= 0.1 * ref_params[k].grad
                ref_params[k].grad = None
                if theirs is not None:
                    their_params[k] -= 0.1 * their_params[k].grad
                    their_params[k].grad = None
    kinds = {k: type(v.to_local()).__name__ for k, v in sharded.items()}
    return out, kinds


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _check(results, subclass: str | None, exact_vs_ref: bool = False):
    for steps, kinds in results:
        if subclass is not None:
            assert subclass in kinds.values(), kinds  # the shards keep the subclass
        for row in steps:
            assert row["vs_ref"] < (1e-6 if exact_vs_ref else 1e-5), steps
            if "vs_fsdp2" in row:
                assert row["vs_fsdp2"] == 0, steps  # the same kernels on the same values
                assert row["bytes"] == row["fsdp2_bytes"], steps
                assert row["counts"] == row["fsdp2_counts"], steps


@pytest.mark.parametrize("world", [2, 4])
def test_qlora_matches_fsdp2_and_the_unsharded_model(worlds, world):
    results = worlds(world).run(three_ways, "qlora", (world,))
    _check(results, "NF4Tensor")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["float8_all_gather", "float8"])
def test_float8_matches_fsdp2_and_the_unsharded_model(worlds, world, kind):
    results = worlds(world).run(three_ways, kind, (world,))
    _check(results, "WeightWithDynamicFloat8CastTensor" if kind != "float8" else None)


def test_float8_all_gather_of_a_group_without_bias_goes_over_gloo(world2):
    # FSDP2 gathers such a group in float8, which gloo refuses; funcshard sends bytes
    results = world2.run(three_ways, "float8_all_gather_no_bias", (2,), 2, False)
    _check(results, "WeightWithDynamicFloat8CastTensor")
    for steps, _ in results:
        assert all(row["counts"]["all_gather"] == 6 for row in steps), steps


def _shards(kind: str, seed: int):
    model, _ = _models(kind, seed)
    return fs.shard(fs.extract(model)[0], mesh(dist.get_world_size()))


def save_model(kind: str, path: str) -> None:
    fs.checkpoint.save(path, {"params": _shards(kind, 0)})


def load_model(kind: str, path: str):
    """Load into a model of other values; per leaf: the loaded shard is of the saved class and
    equals, inner tensor by inner tensor, this world size's shard of the saved model."""
    loaded = fs.checkpoint.load(path, {"params": _shards(kind, 1)})["params"]
    expected = _shards(kind, 0)
    out = {}
    for k, v in loaded.items():
        a, b = v.to_local(), expected[k].to_local()
        names = a.__tensor_flatten__()[0] if type(a) is not torch.Tensor else None
        if names is None:
            same = torch.equal(a, b)
        else:
            same = type(a) is type(b) and all(
                torch.equal(getattr(a, n), getattr(b, n)) for n in names
            )
        out[k] = (type(a).__name__, same, v.requires_grad == expected[k].requires_grad)
    return out


@pytest.mark.parametrize("kind", ["qlora", "float8_all_gather"])
def test_checkpoints_round_trip_and_reshard(worlds, tmp_path, kind):
    path = str(tmp_path / "ckpt")
    worlds(2).run(save_model, kind, path)
    for world in (2, 4):
        for leaves in worlds(world).run(load_model, kind, path):
            assert all(same and grad for _, same, grad in leaves.values()), (world, leaves)
            assert any(t in ("NF4Tensor", "WeightWithDynamicFloat8CastTensor") for t, _, _ in
                       leaves.values()), leaves  # fmt: skip


def materialize_float8():
    """A float8 model built on meta is initialised straight into float8-training shards, of the
    values fs.shard cuts from the same model built normally."""
    warnings.filterwarnings("ignore", category=UserWarning)
    with torch.device("meta"):
        meta = float8_mlp(True)
    torch.manual_seed(0)
    sharded, _ = fs.materialize(meta, mesh(dist.get_world_size()))
    expected = _shards("float8_all_gather", 0)
    out = {}
    for k, v in sharded.items():
        a, b = v.to_local(), expected[k].to_local()
        out[k] = (
            type(a) is type(b),
            torch.equal(getattr(a, "_tensor", a), getattr(b, "_tensor", b)),
        )
    return out


def test_materialize_keeps_float8_weights(world2):
    for leaves in world2.run(materialize_float8):
        assert all(same_type and same for same_type, same in leaves.values()), leaves


def explained_vs_real(kind: str):
    """fs.explain's collectives (kind, bytes in, count) against those of a real step, and its
    groups' shard bytes against the shards' own memory (NF4: the packed data and scales)."""
    warnings.filterwarnings("ignore", category=UserWarning)
    model, unit = _models(kind)
    sharded = fs.shard(fs.extract(model)[0], mesh(dist.get_world_size()))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(unit)))
    x = _inputs(kind, 1, 1)[0, 0]
    e = fs.explain(apply, sharded, x, loss=lambda out, x: out.square().mean())
    with Collectives() as c:
        fs.value_and_grad(lambda p: apply(p, x).square().mean())(sharded)
    size = {d: torch.empty((), dtype=d).element_size() for _, d, _ in c.sent}
    real = sorted((k, n * size[d]) for k, d, n in c.sent)
    predicted = sorted((col.kind, col.in_bytes) for col in e.collectives for _ in range(col.count))
    owned = {}
    for g in e.plan.groups:
        locals_ = [sharded[p].to_local() for p in g.params]
        owned[g.name] = sum(sum(t.numel() * t.element_size() for t in fs_inner(x)) for x in locals_)
    return real, predicted, {g.name: g.shard_bytes for g in e.groups}, owned


def fs_inner(x: torch.Tensor) -> list[torch.Tensor]:
    if type(x) is torch.Tensor:
        return [x]
    names = x.__tensor_flatten__()[0]
    return [t for n in names for t in fs_inner(getattr(x, n))]


@pytest.mark.parametrize("kind", ["qlora", "float8_all_gather"])
def test_explain_counts_the_low_precision_bytes(world2, kind):
    for real, predicted, shard_bytes, owned in world2.run(explained_vs_real, kind):
        assert predicted == real
        assert shard_bytes == owned


def trained(kind: str, graphed: bool, steps: int = 4, compile_backend: str | None = None):
    """``steps`` steps of AdamW on the trained parameters (the NF4 weights stay frozen): eager,
    ``torch.compile``'d, or graphed on ``fs.cuda_graph``'s CPU stand-in. Returns the losses and
    the final full trained parameters."""
    from funcshard._execution._cuda_graph import CudaGraphed, _Rerun

    rank, world = dist.get_rank(), dist.get_world_size()
    model, unit = _models(kind)
    sharded = fs.shard(fs.extract(model)[0], mesh(world))
    frozen = {k: v for k, v in sharded.items() if not v.requires_grad}
    params = {k: v for k, v in sharded.items() if v.requires_grad}
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(unit)))
    vg = fs.value_and_grad(lambda p, f, x: apply({**f, **p}, x).square().mean())
    opt = fs.optim.adamw(1e-2, fused=True, capturable=True)
    state = opt.init(params)

    def step(p, f, s, x):  # the frozen weights too are arguments, not constants of the graph
        loss, grads = vg(p, f, x)
        p, s = fs.optim.step(opt, p, grads, s)
        return loss, p, s

    if compile_backend is not None:
        step = torch.compile(step, backend=compile_backend, fullgraph=True)
    if graphed:
        step = CudaGraphed(step, warmup=2, max_graphs=4, backend=_Rerun())
    batches = _inputs(kind, steps, world)
    losses = []
    for i in range(steps):
        loss, params, state = step(params, frozen, state, batches[i, rank])
        losses.append(loss.item())
    return losses, {k: v.full_tensor() for k, v in params.items()}


def _same(a, b) -> float:
    return max(
        max(abs(x - y) for x, y in zip(a[0], b[0], strict=True)),
        max(_diff(a[1][k], b[1][k]) for k in a[1]),
    )


def graphed_and_compiled(kind: str):
    eager = trained(kind, False)
    return _same(eager, trained(kind, True)), _same(eager, trained(kind, False, 4, "aot_eager"))


@pytest.mark.parametrize("kind", ["qlora", "float8_all_gather"])
def test_compiled_and_graphed_steps_equal_eager(world2, kind):
    for graphed, compiled in world2.run(graphed_and_compiled, kind):
        assert graphed == 0 and compiled == 0


def exported(kind: str):
    """``fs.checkpoint.export_state_dict`` of low-precision shards: each weight's value in its
    dtype (NF4 dequantized, float8 training's float32 weight), as the unsharded model has it."""
    sd = fs.checkpoint.export_state_dict(_shards(kind, 0))
    if dist.get_rank() != 0:
        return None
    ref, _ = _models(kind)
    expected = {k: p.detach().to(p.dtype) for k, p in ref.named_parameters()}
    return {k: (type(v) is torch.Tensor, torch.equal(v, expected[k])) for k, v in sd.items()}


@pytest.mark.parametrize("kind", ["qlora", "float8_all_gather"])
def test_export_state_dict_gives_the_values(world2, kind):
    leaves = world2.run(exported, kind)[0]
    assert all(plain and same for plain, same in leaves.values()), leaves
