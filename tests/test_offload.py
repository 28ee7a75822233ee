"""fs.optim.offload: float32 master weights and the optimizer state in CPU memory, the update on
CPU, the parameters (the compute copy, float32 or bfloat16) receiving the masters. Checked on
the CPU "device" path (no GPU here) against torch's AdamW kernels on float32 parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import funcshard as fs
from funcshard._trees._tree import flatten

from _mesh import mesh

optim = fs.optim
SHAPES = {"w": (7, 5), "v": (3, 10), "b": (7,)}  # uneven; 3 rows over 4 ranks


def _full(step: int):
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _diff(ours, theirs, dtype) -> float:
    """Max difference of the local shards, ``theirs`` rounded to ``dtype`` (0 for empty ones)."""
    return max(
        (ours[k].to_local().float() - theirs[k].to_local().to(dtype).float()).abs().max().item()
        if theirs[k].to_local().numel()
        else 0.0
        for k in theirs
    )


def against_float32(dtype, steps=3):
    m = mesh(dist.get_world_size())
    ref = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.01, weight_decay=0.1))
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.offload(optim.adamw(0.01, weight_decay=0.1))
    )
    # the masters start from the parameters: float32 copies of them
    theirs = fs.shard({k: v.to(dtype).float() for k, v in _full(-1).items()}, m)
    tstate = ref.init(theirs)
    ours = {
        f: fs.shard({k: v.to(dtype) for k, v in _full(-1).items()}, m) for f in ("step", "pure")
    }
    states = {f: opt.init(p) for f, p in ours.items()}
    out = []
    for step in range(steps):
        theirs, tstate = optim.step(ref, theirs, fs.shard(_full(step), m), tstate)
        ours["step"], states["step"] = optim.step(
            opt, ours["step"], fs.shard(_full(step), m), states["step"]
        )
        updates, states["pure"] = opt.update(fs.shard(_full(step), m), states["pure"], ours["pure"])
        ours["pure"] = optim.apply_updates(ours["pure"], updates)
        master = states["step"][1].master
        out.append(
            {
                "master": _diff(master, theirs, torch.float32),
                "compute": _diff(ours["step"], theirs, dtype),
                "pure": _diff(ours["pure"], theirs, dtype),
            }
        )
    kept = flatten(states["step"][1])[1]
    placed = all(
        isinstance(x, DTensor) and x.to_local().device.type == "cpu" and x.dtype == torch.float32
        for x in kept
        if isinstance(x, torch.Tensor) and x.dim()
    )
    dtypes = {str(p.dtype) for p in ours["step"].values()}
    return out, placed, dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_adamw_keeps_float32_masters(world2, world4, dtype):
    for world in (world2, world4):
        for out, placed, dtypes in world.run(against_float32, dtype):
            assert placed and dtypes == {str(dtype)}
            for e in out:
                # the masters are torch's AdamW on float32 shards (the clip's norm sums in another
                # order than in the reference only if the dtypes differ: bfloat16 gradients)
                assert e["master"] == 0 and e["compute"] == 0, out
                # the pure form returns new - old in the parameters' dtype
                assert e["pure"] <= (1e-6 if dtype == torch.float32 else 2**-7), out


def offload_checkpoint(path: str):
    m = mesh(dist.get_world_size())
    opt = optim.offload(optim.adamw(0.01))
    params = fs.shard({k: v.bfloat16() for k, v in _full(-1).items()}, m)
    params, state = optim.step(opt, params, fs.shard(_full(0), m), opt.init(params))
    fs.checkpoint.save(path, {"opt": state})
    loaded = fs.checkpoint.load(path, {"opt": opt.init(params)})["opt"]
    pairs = zip(flatten(state)[1], flatten(loaded)[1], strict=True)
    same = all(
        torch.equal(a.to_local(), b.to_local()) if isinstance(a, DTensor) else torch.equal(a, b)
        for a, b in pairs
    )
    on_cpu = all(
        x.to_local().device.type == "cpu" for x in flatten(loaded)[1] if isinstance(x, DTensor)
    )
    return same, on_cpu, int(loaded.inner.count)


def test_offloaded_state_checkpoints(world2, tmp_path):
    for same, on_cpu, count in world2.run(offload_checkpoint, str(tmp_path / "ckpt")):
        assert same and on_cpu and count == 1
