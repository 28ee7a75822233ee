"""A training run, not just a step: no leak over many steps, frozen and integer parameters get no
gradient and no communication, on every path."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard._communication import _collectives

from _comm import Collectives
from _mesh import mesh
from _models import Block, lm_loss, make, reference_step, shard_of, tokens


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def long_run(mode: str, steps: int = 34, warmup: int = 4, recompute=None):
    """``steps`` SGD steps of the scheduled TinyLM; live tensors after each step."""
    model = make(layers=2, batchnorm=False)  # BatchNorm under torch.func needs buffers as args
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block), recompute=recompute))
    model.to("meta")
    loss_fn = lambda p, t: lm_loss(apply(p, t, buffers=buffers), t)
    counts = []
    for step in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a clean log: no deprecation or out-of-plan warning
            _step(mode, loss_fn, sharded, tokens(dist.get_rank(), step=step))
        if step in (warmup - 1, steps - 1):
            counts.append(_live_tensors())
    # no collective left pending: c10d's registry would keep it (and warn, or abort, at exit)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    assert not _collectives._UNFINISHED  # every gather waited for: none left for the exit handler
    return counts


def _step(mode, loss_fn, sharded, batch) -> None:
    if mode == "value_and_grad":
        _, grads = fs.value_and_grad(loss_fn)(sharded, batch)
    elif mode == "backward":
        leaves = {k: v.detach().requires_grad_() for k, v in sharded.items()}
        loss_fn(leaves, batch).backward()
        grads = {k: v.grad for k, v in leaves.items()}
    else:
        grads = fs.from_local(torch.func.grad(loss_fn)(fs.to_local(sharded), batch))
    with torch.no_grad():
        for k, p in sharded.items():
            p -= 0.01 * grads[k]


@pytest.mark.parametrize("mode", ["value_and_grad", "backward", "torch_func"])
def test_scheduled_training_does_not_leak(world2, mode):
    """30 steps after warm-up: the number of live tensors stays flat (each step used to keep
    its whole per-call state alive through the post-backward callback)."""
    for warm, end in world2.run(long_run, mode):
        assert end <= warm, (warm, end)


class Frozen(nn.Module):
    """A trainable block, a frozen linear, a frozen integer table, and a frozen group."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.weight.requires_grad_(False)  # bias stays trainable: a mixed group
        self.table = nn.Parameter(torch.arange(7), requires_grad=False)  # integer
        self.head = nn.Sequential(nn.Linear(6, 3))
        self.head.requires_grad_(False)  # a whole frozen group

    def forward(self, x):
        h = torch.tanh(self.a(x)) + self.table[:6].float()
        return self.head(self.frozen(h)).square().mean()


FROZEN = ("frozen.weight", "table", "head.0.weight", "head.0.bias")


def frozen_paths():
    torch.manual_seed(0)
    model = Frozen()
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    ref = make(Frozen)
    _, ref_grads, _ = reference_step(
        ref,
        [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)],
        loss_fn=lambda out, _: out,
    )
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_names(["frozen", "head"])))
    unsharded = lambda p: fs.functional_call(model, fs.unshard(p), (x,))
    paths = {"unshard": unsharded, "schedule": lambda p: apply(p, x)}
    out = {}
    for name, loss in paths.items():
        rec = Collectives()
        with rec:
            _, grads = fs.value_and_grad(loss)(sharded)
        out[name] = _summary(grads, ref_grads, rec)
    # reduce: unreduced full gradients (None for frozen leaves), then one reduce
    _, full = fs.value_and_grad(unsharded, sync_grads=False)(sharded)
    rec = Collectives()
    with rec:
        grads = fs.reduce(full, sharded)
    out["reduce"] = _summary(grads, ref_grads, rec)
    out["unreduced_none"] = sorted(k for k, g in full.items() if g is None)
    return out


def _summary(grads, ref, rec):
    err = max(
        (g.to_local() - shard_of(ref[k], g)).abs().max().item()
        for k, g in grads.items()
        if g is not None and g.to_local().numel()
    )
    return {
        "none": sorted(k for k, g in grads.items() if g is None),
        "ref_none": sorted(k for k, g in ref.items() if g is None),
        "err": err,
        "reduced": sum(n for kind, _, n in rec.sent if kind == "reduce_scatter"),
    }


def test_frozen_and_integer_parameters_get_no_gradient(world2):
    """Frozen float and integer parameters get None (as torch.autograd leaves .grad None) on
    every path, trainable ones match the unsharded model, and only trainable elements are
    reduce-scattered: a.weight (6x5) + a.bias (6) + frozen.bias (6), each padded to 2 ranks."""
    trainable = 6 * 5 + 6 + 6
    for r in world2.run(frozen_paths):
        assert r["unreduced_none"] == sorted(FROZEN)
        for path in ("unshard", "schedule", "reduce"):
            assert r[path]["none"] == sorted(FROZEN) == r[path]["ref_none"], (path, r[path])
            assert r[path]["err"] < 1e-6, (path, r[path])
            assert r[path]["reduced"] == trainable, (path, r[path])


def all_frozen_tree_is_differentiated():
    """A tree in which no leaf requires grad (an out-of-place update under no_grad) is
    differentiated whole, as jax.grad does; an integer leaf still gets None."""
    m = mesh(dist.get_world_size())
    sharded = fs.shard({"w": torch.ones(4, 2), "i": torch.arange(4)}, m)
    with torch.no_grad():
        sharded = {"w": sharded["w"] * 2, "i": sharded["i"]}
    grads = fs.grad(lambda p: (fs.unshard(p)["w"] * p["i"].full_tensor()[:, None]).sum())(sharded)
    return grads["i"] is None, grads["w"].full_tensor()[:, 0].tolist()


def test_tree_without_requires_grad_is_differentiated_whole(world2):
    for none, w in world2.run(all_frozen_tree_is_differentiated):
        assert none and w == [0.0, 1.0, 2.0, 3.0]
