"""Forwards that take different paths on different ranks: a scheduled call issues the plan's
collectives whatever its forward does (see [Note: the collectives follow the plan] in
``funcshard/_execution/_deviation.py``).

A rank whose forward skips blocks (data-dependent control flow, a layer dropped on that rank)
gets the gradients of the unsharded model -- every rank's own path, averaged -- under
``value_and_grad``, ``.backward()`` and ``torch.func.grad``, with every plan shape, and trains
as the unsharded model does. A use the plan cannot serve without a gather of its own (a block
used twice where the plan runs it once, blocks used out of order) is an error naming the group
and the rank on every rank at the next call: no process aborts, and the ranks are in step
afterwards."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

from _mesh import mesh


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h):
        return torch.tanh(self.fc(h))


class Net(nn.Module):
    """An embedding, blocks run in the order ``path`` gives (all by default), a head; the blocks
    in ``dropped`` are computed and their output dropped."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(4, 2)

    def forward(self, x, path=None, dropped=()):
        h = self.embed(x)
        for i in range(len(self.blocks)) if path is None else path:
            y = self.blocks[i](h)
            h = h if i in dropped else h + y
        return self.head(h)


def _setup(mesh_shape=None, **plan_options):
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    params, _ = fs.extract(net)
    sharded = fs.shard(params, mesh(*(mesh_shape or (dist.get_world_size(),))))
    net.to("meta")
    apply = fs.schedule(net, fs.plan(net, fs.policy.by_type(Block), **plan_options))
    return reference, sharded, apply


def _x(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _reference(reference: nn.Module, xs, paths) -> dict[str, torch.Tensor]:
    """The unsharded model's gradients: each rank's path on its own batch, averaged."""
    grads = {k: torch.zeros_like(p) for k, p in reference.named_parameters()}
    for x, path in zip(xs, paths, strict=True):
        reference.zero_grad()
        _loss(reference(x, path)).backward()
        for k, p in reference.named_parameters():
            if p.grad is not None:
                grads[k] += p.grad / len(xs)
    return grads


def _err(grads, expected) -> float:
    return max((grads[k] - expected[k]).abs().max().item() for k in grads)


def _grads(mode: str, apply, sharded, x, path) -> dict[str, torch.Tensor]:
    """This rank's gradients (full tensors) of ``_loss(apply(...))`` through ``mode``."""
    loss = lambda p: _loss(apply(p, x, path))
    if mode == "value_and_grad":
        grads = fs.value_and_grad(loss)(sharded)[1]
    elif mode == "backward":
        leaves = {k: v.detach().requires_grad_() for k, v in sharded.items()}
        loss(leaves).backward()
        grads = {k: v.grad for k, v in leaves.items()}
    else:
        grads = fs.from_local(torch.func.grad(loss)(fs.to_local(sharded)))
    return {k: g.full_tensor() for k, g in grads.items()}


# the last rank's path, the others running every block
SKIPS = {"a middle block": (0, 2, 3), "the last": (0, 1, 2), "the first": (1, 2, 3), "all": ()}
MODES = ("value_and_grad", "backward", "torch.func")


def skipping(plan_options: dict, mesh_shape=None) -> list[tuple[str, str, float]]:
    """For each skip of the last rank's and each way to differentiate, the largest difference
    from the unsharded model's gradients; and the forward under no_grad's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded, apply = _setup(mesh_shape, **plan_options)
    xs = [_x(r) for r in range(world)]
    out = []
    for name, path in SKIPS.items():
        paths = [None] * (world - 1) + [path]
        expected = _reference(reference, xs, paths)
        for mode in MODES:
            grads = _grads(mode, apply, sharded, xs[rank], paths[rank])
            out.append((name, mode, _err(grads, expected)))
        with torch.no_grad():
            value = apply(sharded, xs[rank], paths[rank])
            out.append((name, "no_grad", _err({"": value}, {"": reference(xs[rank], paths[rank])})))
    return out


PLANS = {
    "default": {},
    "no prefetch": {"prefetch": 0, "backward_prefetch": 0},
    "prefetch 2": {"prefetch": 2},
    "kept after forward": {"reshard_after_forward": False},
    "recompute": {"recompute": True},
}


@pytest.mark.parametrize("plan", PLANS)
def test_a_rank_that_skips_blocks_gets_the_unsharded_models_gradients(world2, plan):
    for results in world2.run(skipping, PLANS[plan]):
        for name, mode, err in results:
            assert err < 1e-6, (name, mode, err)


@pytest.mark.parametrize(
    ("mesh_shape", "plan"),
    [((2, 2), {}), (None, {"reshard_after_forward": 2})],
    ids=["hsdp", "resharded to 2 of 4 ranks"],
)
def test_a_rank_that_skips_blocks_on_4_ranks(world4, mesh_shape, plan):
    """2 x 2 (replicate, shard): the reduce-scatter of zeros is all-reduced over the replicas;
    1 x 4 with FSDP2's int reshard: the backward re-gathers within sub-groups of 2 ranks."""
    for results in world4.run(skipping, plan, mesh_shape):
        for name, mode, err in results:
            assert err < 1e-6, (name, mode, err)


def layer_drop(steps: int):
    """Training where each rank drops each block with probability 1/2, drawn on that rank: the
    paths taken and the parameters after each step."""
    rank = dist.get_rank()
    _, sharded, apply = _setup()
    draw = torch.Generator().manual_seed(7 + rank)
    opt = fs.optim.adamw(1e-2)
    state = opt.init(sharded)
    vg = fs.value_and_grad(lambda p, x, path: _loss(apply(p, x, path)))
    paths, params = [], []
    for step in range(steps):
        path = [i for i in range(4) if torch.rand((), generator=draw) < 0.5]
        _, grads = vg(sharded, _x(rank, step), path)
        sharded, state = fs.optim.step(opt, sharded, grads, state)
        paths.append(path)
        params.append({k: v.full_tensor() for k, v in sharded.items()})
    return paths, params


def test_layer_drop_on_each_rank_trains_as_the_unsharded_model(world2):
    (paths0, params0), (paths1, params1) = world2.run(layer_drop, 5)
    assert paths0 != paths1  # the ranks took different paths
    torch.manual_seed(0)
    reference = Net()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step, paths in enumerate(zip(paths0, paths1, strict=True)):
        grads = _reference(reference, [_x(r, step) for r in range(2)], paths)
        for k, p in reference.named_parameters():
            p.grad = grads[k]
        opt.step()
        for k, p in reference.named_parameters():
            torch.testing.assert_close(params0[step][k], p.detach(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(params1[step][k], p.detach(), atol=1e-6, rtol=1e-5)


def deviating(paths, reshard=True) -> dict:
    """Rank 1 runs the blocks along ``paths[1]``, rank 0 along ``paths[0]``: what each call of
    three gives (the deviating one, the next, the one after, both with every block) and the
    warnings of the first; the last call's gradients against the unsharded model's."""
    rank = dist.get_rank()
    reference, sharded, apply = _setup(reshard_after_forward=reshard)
    x = _x(rank)
    found = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fs.value_and_grad(lambda p: _loss(apply(p, x, paths[rank])))(sharded)
            found["deviating"] = None
        except RuntimeError as e:
            found["deviating"] = str(e)
    found["warnings"] = [str(w.message) for w in caught if "funcshard" in str(w.message)]
    try:
        fs.value_and_grad(lambda p: _loss(apply(p, x)))(sharded)
        found["next"] = None
    except RuntimeError as e:
        found["next"] = str(e)
    grads = _grads("value_and_grad", apply, sharded, x, None)
    expected = _reference(reference, [_x(r) for r in range(2)], [None, None])
    found["after"] = _err(grads, expected)
    return found


DEVIATIONS = {  # rank 1's path, the group it names, what it says
    "twice": ((0, 1, 2, 1, 3), "blocks.1", "the plan's last run of it had passed"),
    "out of order": ((0, 2, 1, 3), "blocks.1", "the plan's last run of it had passed"),
    "an early block last": ((1, 2, 3, 0), "blocks.0", "the plan's last run of it had passed"),
}


@pytest.mark.parametrize("case", DEVIATIONS)
def test_a_block_the_plan_cannot_serve_is_an_error_on_every_rank_without_an_abort(case):
    """Its own pool: an abort (gloo's ``EnforceNotMet`` on mismatched sizes) would end a rank
    process, which ``Pool.run`` reports as a ``RankError`` ("exited with code -6")."""
    path, group, says = DEVIATIONS[case]
    with fs.testing.Pool(2, timeout=120) as pool:
        found0, found1 = pool.run(deviating, [None, path])
    for found in (found0, found1):
        assert found["deviating"] is None  # the step finishes on every rank, in step
        assert found["after"] < 1e-6  # and the ranks are in step afterwards
    own = found1["next"]
    assert own is not None and f"schedule: rank 1's forward used group {group!r}" in own, own
    assert says in own and "example_args" in own and "order=" in own
    assert found0["next"] == f"schedule: rank 1 raised RuntimeError: {own}" + (
        " (raised on every rank, before any collective of this call, so that the ranks stay in "
        "step)"
    )
    assert found0["warnings"] == [] and found1["warnings"] == [f"funcshard: {own}"]


@pytest.mark.parametrize("case", ["twice", "out of order"])
def test_an_unsharded_group_is_served_out_of_order_exactly(world2, case):
    """With ``reshard_after_forward=False`` a use out of the plan's order needs no gather: the
    gradients are the unsharded model's, with no warning."""
    path = DEVIATIONS[case][0]
    for found in world2.run(deviating, [None, path], reshard=False):
        assert found["deviating"] is None and found["next"] is None and found["warnings"] == []
        assert found["after"] < 1e-6


def test_an_output_dropped_on_every_rank_is_no_error(world2):
    """Every rank drops block 2's output: nothing reaches its gather's backward on any rank, and
    its gradient is zero, which is right (the backward cursor passes its run: no error)."""
    for found in world2.run(dropping_everywhere):
        assert found["next"] is None and found["after"] < 1e-6


def dropping_everywhere() -> dict:
    """Every rank drops block 2's output: the gradients against the unsharded model's, and
    whether the next call raises."""
    rank = dist.get_rank()
    reference, sharded, apply = _setup()
    x = _x(rank)
    _, grads = fs.value_and_grad(lambda p: _loss(apply(p, x, None, (2,))))(sharded)
    grads = {k: g.full_tensor() for k, g in grads.items()}
    expected = {k: torch.zeros_like(p) for k, p in reference.named_parameters()}
    for r in range(2):
        reference.zero_grad()
        _loss(reference(_x(r), None, (2,))).backward()
        for k, p in reference.named_parameters():
            if p.grad is not None:
                expected[k] += p.grad / 2
    try:
        fs.unshard(fs.shard({"w": torch.ones(2)}, mesh(2)))
        found = {"next": None}
    except RuntimeError as e:
        found = {"next": str(e)}
    found["after"] = _err(grads, expected)
    return found


_JOB = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
import funcshard as fs

sys.path.insert(0, sys.argv[2])
from test_control_flow import Block, Net, _loss

case = sys.argv[1]
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
net = Net()
params, _ = fs.extract(net)
sharded = fs.shard(params, mesh)
net.to("meta")
apply = fs.schedule(net, fs.plan(net, fs.policy.by_type(Block)))
vg = fs.value_and_grad(lambda p, x, path: _loss(apply(p, x, path)))
path = {"skip": (0, 1, 3), "twice": (0, 1, 2, 1, 3)}[case] if dist.get_rank() == 1 else None
for step in range(3):
    vg(sharded, torch.randn(5, 3), path)
    print(f"rank {dist.get_rank()} finished step {step}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("case", ["skip", "twice"])
def test_a_job_whose_ranks_take_different_paths_ends_without_an_abort(tmp_path, case):
    """Two torchrun ranks, rank 1 skipping a block (the job finishes) or using one twice (every
    rank exits with the error, code 1): never gloo's abort (``terminate called after throwing an
    instance of 'gloo::EnforceNotMet'``, signal 6), which is what a mismatched gather gives."""
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    tests = str(__import__("pathlib").Path(__file__).parent)
    job = subprocess.run(
        [*launch, "2", str(script), case, tests], capture_output=True, text=True, timeout=600
    )
    out = job.stdout + job.stderr
    assert not any(a in out for a in ("terminate called", "Signal 6", "SIGABRT")), out[-3000:]
    if case == "skip":
        assert job.returncode == 0, out[-3000:]
        assert "rank 0 finished step 2" in out and "rank 1 finished step 2" in out
    else:
        assert job.returncode == 1, out[-3000:]
        assert "rank 0 finished step 0" in out and "rank 1 finished step 0" in out
        assert "finished step 1" not in out  # every rank raised at its next call
        assert "RuntimeError: schedule: rank 1's forward used group 'blocks.1'" in out
        assert "RuntimeError: schedule: rank 1 raised RuntimeError" in out
