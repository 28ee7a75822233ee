"""fs.checkpoint interop: full state dicts out (to a fresh module, safetensors, torch.save) and in
(each rank reading its slices), and FSDP2 checkpoints in both directions."""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes

from _checks import raises
from _mesh import mesh
from _models import Wide, make, tokens

LAYOUTS = [
    pytest.param(2, (2,), Shard(0), id="Shard(0)"),
    pytest.param(2, (2,), Shard(1), id="Shard(1)"),
    pytest.param(4, (2, 2), (Replicate(), Shard(0)), id="HSDP"),
]


def trained_model():
    """TinyLM (tied embedding/head, BatchNorm) with non-default running statistics."""
    model = make(seed=0)
    model(tokens(0))  # train mode: updates the BatchNorm buffers
    return model


def placements(pl):
    """``pl``, with ``Shard(1)`` on 1-d tensors turned into ``Shard(0)``."""
    return lambda path, t: Shard(0) if pl == Shard(1) and t.dim() == 1 else pl


def export_to_fresh_modules(directory: str, mesh_shape, pl) -> list:
    model = trained_model()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(*mesh_shape), placements(pl))
    meta = copy.deepcopy(model)
    fs.extract(meta)  # funcshard remembers its ties ...
    meta.to("meta")  # ... when the module keeps no weights
    files = [f"{directory}/model.safetensors", f"{directory}/model.pt"]
    exported = [
        fs.checkpoint.export_state_dict(sharded, meta, buffers=buffers, path=file) for file in files
    ]
    if dist.get_rank() != 0:
        return [e is None for e in exported]
    sd = exported[0]
    checks = [list(sd) == list(reference), sd["head.weight"] is sd["embed.weight"]]

    def equal(module) -> bool:
        return all(torch.equal(v, reference[k]) for k, v in module.state_dict().items())

    fresh = make(seed=1)  # another initialisation
    fresh.load_state_dict(sd)  # strict
    checks.append(equal(fresh) and fresh.head.weight is fresh.embed.weight)
    # the trap: to_empty unties, the alias must be in the state dict (strict catches it)
    empty = copy.deepcopy(meta).to_empty(device="cpu")
    empty.load_state_dict(sd)
    checks.append(equal(empty))
    from_safetensors = make(seed=2)
    safetensors.torch.load_model(from_safetensors, files[0])  # strict; each tensor stored once
    checks.append(equal(from_safetensors))
    checks.append("head.weight" not in safetensors.torch.load_file(files[0]))
    from_torch = make(seed=3)
    from_torch.load_state_dict(torch.load(files[1], weights_only=True))
    checks.append(equal(from_torch))
    return checks


@pytest.mark.parametrize(("n", "mesh_shape", "pl"), LAYOUTS)
def test_export_loads_into_fresh_modules(request, tmp_path, n, mesh_shape, pl):
    world = request.getfixturevalue(f"world{n}")
    results = world.run(export_to_fresh_modules, str(tmp_path), mesh_shape, pl)
    assert results[0] == [True] * 7
    assert all(r == [True, True] for r in results[1:])  # None on the other ranks


def export_memory() -> tuple[int, int, int]:
    """(peak bytes allocated during the export, model bytes, largest tensor bytes)."""
    model = make(Wide, d=128, layers=4)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(2))
    model.to("meta")
    peak, _ = peak_bytes(lambda: fs.checkpoint.export_state_dict(sharded))
    sizes = [p.numel() * p.element_size() for p in params.values()]
    return peak, sum(sizes), max(sizes)


def test_export_holds_the_full_model_once_on_one_rank(world2):
    (peak0, total, largest), (peak1, *_) = world2.run(export_memory)
    assert total <= peak0 <= total + largest  # the result, and one received piece at a time
    assert peak1 < largest / 4  # the other rank only sends its shards


def import_slices(directory: str, mesh_shape, pl) -> list:
    m = mesh(*mesh_shape)
    model = trained_model()
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, m, placements(pl))
    meta = {k: v.to("meta") for k, v in params.items()}
    like = {**fs.shard(meta, m, placements(pl)), **{k: v.to("meta") for k, v in buffers.items()}}
    checks = []
    for file in (f"{directory}/model.safetensors", f"{directory}/model.pt"):
        fs.checkpoint.export_state_dict(sharded, model, buffers=buffers, path=file)
        checks += import_checks(file, like, sharded, buffers)
    in_memory = fs.checkpoint.import_state_dict(model.state_dict(), like)  # a mapping works too
    checks.append(torch.equal(in_memory["pos"].full_tensor(), model.pos.detach()))
    return checks


def import_checks(file: str, like: dict, sharded: dict, buffers: dict) -> list:
    imported = fs.checkpoint.import_state_dict(file, like)
    same = all(
        imported[k].placements == v.placements and torch.equal(imported[k].to_local(), v.to_local())
        for k, v in sharded.items()
    ) and all(torch.equal(imported[k], v) for k, v in buffers.items())
    load = lambda tree, **kw: fs.checkpoint.import_state_dict(file, tree, **kw)
    wrong = fs.shard({"pos": torch.empty(4, 16, device="meta")}, like["pos"].device_mesh)
    return [
        same,
        raises(lambda: load(sharded), ValueError, "running_mean", "strict=False"),  # no buffers
        raises(lambda: load({**like, "nope": like["pos"]}), KeyError, "'nope' is not in"),
        raises(lambda: load(wrong, strict=False), ValueError, "'pos' has shape [8, 16]"),
    ]


@pytest.mark.parametrize(("n", "mesh_shape", "pl"), LAYOUTS)
def test_import_reads_each_ranks_slices(request, tmp_path, n, mesh_shape, pl):
    world = request.getfixturevalue(f"world{n}")
    expected = [True, None, None, None] * 2 + [True]
    assert world.run(import_slices, str(tmp_path), mesh_shape, pl) == [expected] * n


# --- FSDP2 -----------------------------------------------------------------------------------


def fsdp2_model(seed: int, m):
    model = make(seed=seed)
    model(tokens(0))
    for block in model.blocks:
        fully_shard(block, mesh=m)
    fully_shard(model, mesh=m)
    return model


def fsdp2_to_funcshard(directory: str) -> list:
    m = mesh(2)
    ref = fsdp2_model(0, m)
    dcp.save(get_model_state_dict(ref), checkpoint_id=directory)
    params, buffers = fs.extract(make(seed=1))
    like = {**fs.shard(params, m), **buffers}
    # FSDP2's state dict also holds the tied alias: a strict load names it
    checks = [raises(lambda: fs.checkpoint.load(directory, like), ValueError, "'head.weight'")]
    loaded = fs.checkpoint.load(directory, like, strict=False)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
    expected = {k: full(v) for k, v in ref.state_dict().items()}
    checks.append(all(torch.equal(full(v), expected[k]) for k, v in loaded.items()))
    return checks


def funcshard_to_fsdp2(directory: str) -> list:
    m = mesh(2)
    model = trained_model()
    params, buffers = fs.extract(model)
    fs.checkpoint.save(directory, {**fs.shard(params, m, placements(Shard(1))), **buffers})
    target = fsdp2_model(1, m)
    fsdp_params, fsdp_buffers = fs.extract(target)  # FSDP2's DTensor parameters, ties once
    loaded = fs.checkpoint.load(directory, {**fsdp_params, **fsdp_buffers})  # the same keys
    missing, unexpected = target.load_state_dict(loaded, strict=False)
    checks = [missing == ["head.weight"] and unexpected == []]  # only the alias: it is tied
    state = target.state_dict()
    checks.append(all(torch.equal(state[k].full_tensor(), v.detach()) for k, v in params.items()))
    checks.append(all(torch.equal(state[k], v) for k, v in buffers.items()))
    model.eval(), target.eval()
    checks.append(torch.equal(target(tokens(1)), model(tokens(1))))
    return checks


def test_fsdp2_checkpoint_loads_into_funcshard(world2, tmp_path):
    assert world2.run(fsdp2_to_funcshard, str(tmp_path / "fsdp2")) == [[None, True]] * 2


def test_funcshard_checkpoint_loads_into_fsdp2(world2, tmp_path):
    assert world2.run(funcshard_to_fsdp2, str(tmp_path / "funcshard")) == [[True] * 4] * 2
