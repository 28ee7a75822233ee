"""fs.optim.shard_state: the optimizer state more sharded than the parameters (ZeRO-1 for
replicated parameters on 2 and 4 ranks, HSDP), against the same optimizer with its state placed
like the parameters: the same parameters, a 1/W share of the state, one all-gather per leaf."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs
from funcshard._trees._tree import flatten

from _checks import raises
from _mesh import mesh

optim = fs.optim
SHAPES = {"w": (7, 5), "v": (3, 10), "b": (7,), "s": ()}  # uneven; 3 rows over 4 ranks


def _full(step: int, shapes=SHAPES):
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _opt(name: str):
    if name == "muon":
        return optim.muon(0.02)
    return optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(0.01, weight_decay=0.1))


def _state_numel(state) -> int:
    return sum(x.to_local().numel() for x in flatten(state)[1] if isinstance(x, DTensor))


def against_params_layout(mesh_shape, name, steps=3):
    m = mesh(*mesh_shape)
    shapes = {k: s for k, s in SHAPES.items() if name != "muon" or len(s) == 2}
    place = (Replicate(),) * len(mesh_shape) if len(mesh_shape) == 1 else None  # DDP; or HSDP
    full = _full(-1, shapes)
    ref, opt = _opt(name), optim.shard_state(_opt(name))
    theirs = fs.shard(full, m, place)
    ours = {f: fs.shard(full, m, place) for f in ("step", "pure")}
    tstate = ref.init(theirs)
    states = {f: opt.init(p) for f, p in ours.items()}
    errs, comms = [], []
    for step in range(steps):

        def grads(step=step):
            return fs.shard(_full(step, shapes), m, place)

        theirs, tstate = optim.step(ref, theirs, grads(), tstate)
        with CommDebugMode() as mode:
            ours["step"], states["step"] = optim.step(opt, ours["step"], grads(), states["step"])
        comms.append({str(k): v for k, v in mode.get_comm_counts().items()})
        updates, states["pure"] = opt.update(grads(), states["pure"], ours["pure"])
        ours["pure"] = optim.apply_updates(ours["pure"], updates)
        errs.append({
            f: max((ours[f][k].to_local() - theirs[k].to_local()).abs().max().item()
                   for k in theirs)
            for f in ours
        })  # fmt: skip
    placed = all(ours["step"][k].placements == theirs[k].placements for k in theirs)
    return errs, comms, placed, _state_numel(states["step"]), _state_numel(tstate)


@pytest.mark.parametrize(
    ("world", "mesh_shape", "name"),
    [("world2", (2,), "adamw"), ("world4", (4,), "adamw"), ("world4", (2, 2), "adamw"),
     ("world2", (2,), "muon"), ("world4", (4,), "muon")],
)  # fmt: skip
def test_state_sharded_apart_from_the_parameters(request, world, mesh_shape, name):
    n = 1
    for size in mesh_shape:
        n *= size
    for errs, comms, placed, ours, theirs in request.getfixturevalue(world).run(
        against_params_layout, mesh_shape, name
    ):
        assert placed
        for e in errs:
            # the same kernels on the same numbers; the global norm sums in another order
            assert e["step"] <= (0 if name == "muon" else 1e-6) and e["pure"] <= 1e-6, errs
        if len(mesh_shape) == 1:  # replicated parameters: each rank keeps ~1/W of the state
            assert ours <= theirs / n + 2 * len(SHAPES) * 10, (ours, theirs)
        else:  # HSDP: the state is sharded over the replica dim as well
            assert ours < theirs, (ours, theirs)
        gathers = sum(v for k, v in comms[0].items() if "all_gather" in k)
        assert gathers >= 1, comms


def bad_placements():
    m = mesh(dist.get_world_size())
    params = fs.shard({"w": torch.randn(4, 4)}, m)  # Shard(0)
    opt = optim.shard_state(optim.adamw(0.1), lambda path, p: (Shard(1),))
    return raises(lambda: opt.init(params), ValueError, "'w' do not refine its placements")


def test_state_placements_must_refine_the_parameters(world2):
    assert world2.run(bad_placements) == [None, None]
