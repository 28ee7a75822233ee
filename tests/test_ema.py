"""fs.optim.ema on uneven shards (2 and 4 ranks, a rank with an empty shard) against a hand
computation on the full tensors; no communication; placed like the parameters; checkpointed and
resharded."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs

from _checks import raises
from _mesh import mesh

SHAPES = {"w": (7, 3), "b": (3,), "v": (2, 5)}  # 3 rows over 4 ranks: one rank holds none


def _full(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}


def averages(decay: float, dtype, path: str | None):
    m = mesh(dist.get_world_size())
    avg = fs.optim.ema(decay, dtype=torch.float32 if dtype == torch.bfloat16 else None)
    state, pure = (avg.init(fs.shard(_full(0, dtype), m)) for _ in range(2))
    hand = {k: v.double() for k, v in _full(0, dtype).items()}
    with CommDebugMode() as mode:
        for step in range(1, 4):
            params = fs.shard(_full(step, dtype), m)
            state = avg.update_inplace(state, params)
            pure = avg.update(pure, params)
            hand = {k: decay * hand[k] + (1 - decay) * _full(step, dtype)[k].double() for k in hand}
    placed = all(
        isinstance(a, DTensor)
        and (a.shape, a.placements) == (params[k].shape, params[k].placements)
        and a.to_local().shape == params[k].to_local().shape
        for k, a in state.average.items()
    )
    err = max((state.average[k].full_tensor().double() - hand[k]).abs().max().item() for k in hand)
    same = all(torch.equal(state.average[k].to_local(), pure.average[k].to_local()) for k in hand)
    if path is not None:
        fs.checkpoint.save(path, {"ema": state})
    full = {k: a.full_tensor() for k, a in state.average.items()}
    return err, same, placed, mode.get_total_counts(), int(state.count), full


def load(path: str, dtype):
    m = mesh(dist.get_world_size())
    avg = fs.optim.ema(0.9, dtype=torch.float32 if dtype == torch.bfloat16 else None)
    like = {"ema": avg.init(fs.shard(_full(0, dtype), m))}
    state = fs.checkpoint.load(path, like)["ema"]
    return int(state.count), {k: a.full_tensor() for k, a in state.average.items()}


def test_ema_matches_hand_computation_on_uneven_shards(world2, world4, tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        path = str(tmp_path / f"ema-{dtype}")
        for world in (world2, world4):
            ranks = world.run(averages, 0.9, dtype, path if world is world4 else None)
            for err, same, placed, comms, count, _ in ranks:
                # the average of bfloat16 parameters is kept in float32 (dtype=)
                assert err < 1e-6 and same and placed and comms == 0 and count == 3
        # saved on 4 ranks, loaded on 2: the same averages
        saved = ranks[0][-1]
        for count, full in world2.run(load, path, dtype):
            assert count == 3 and all(torch.equal(full[k], saved[k]) for k in saved)


def test_ema_plain_tensors_and_errors():
    avg = fs.optim.ema(0.5)
    params = {"w": torch.ones(2), "steps": torch.zeros(2, dtype=torch.int64)}
    state = avg.init(params)
    state = avg.update(state, {"w": torch.full((2,), 3.0), "steps": params["steps"]})
    assert torch.equal(state.average["w"], torch.full((2,), 2.0))
    assert state.average["steps"] is None
    problems = [
        raises(lambda: fs.optim.ema(1.5), ValueError, "decay=1.5"),
        raises(lambda: avg.update(state, {"w": torch.ones(2)}), ValueError, "does not match"),
        raises(lambda: avg.update((), params), TypeError, "not the EmaState"),
    ]
    assert problems == [None] * len(problems), problems
