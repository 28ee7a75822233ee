"""Recompute groups whose modules return more than tensors, and recomputations that differ from
their forward: a group's output may be any pytree (``None`` and other non-tensor leaves come back
as the forward returned them), and a recompute that would silently differ from the forward (state
written during the forward, e.g. a key/value cache) is an error naming the group, under plain
autograd and inside torch.func transforms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import grad

import funcshard as fs

from _mesh import mesh
from _models import lm_loss, make, reference_step, shard_of, tokens

MODES = ["value_and_grad", "torch_func"]


def _setup(model, policy, **plan_kw):
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh(dist.get_world_size()))
    plan = fs.plan(model, fs.policy.by_type(policy), **plan_kw)
    model.to("meta")  # the documented pattern: the module keeps no weights
    return sharded, {k: v.clone() for k, v in buffers.items()}, plan


def _grads(mode, loss, sharded):
    """``loss``'s gradients for ``sharded``: through ``fs.value_and_grad`` or ``torch.func.grad``
    (over the local shards), as ``{fqn: DTensor}``."""
    if mode == "value_and_grad":
        return fs.value_and_grad(loss)(sharded)[1]
    return fs.from_local(grad(loss)(fs.to_local(sharded)))


def _err(grads, ref):
    return max(
        (g.to_local() - shard_of(ref[k], g)).abs().max().item()
        for k, g in grads.items()
        if g.to_local().numel()
    )


# --- outputs that are not tensors -------------------------------------------------------------


class Plural(nn.Module):
    """A block returning a pytree with ``None`` and other non-tensor leaves (as T5's blocks
    return ``(hidden, bias, None)``), optionally with a BatchNorm."""

    def __init__(self, d: int, batchnorm: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d) if batchnorm else nn.Identity()

    def forward(self, x, bias=None):
        h = self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2)
        h = torch.tanh(h if bias is None else h + bias)
        return h, None, {"scale": h.mean(), "steps": 2, "none": None, "mask": h > 0}


class PluralNet(nn.Module):
    def __init__(self, vocab=37, d=8, layers=2, batchnorm=True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Plural(d, batchnorm) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h, bias = self.embed(tokens), None
        for block in self.blocks:
            h, nothing, extra = block(h, bias)
            assert nothing is None and extra["none"] is None and extra["steps"] == 2
            assert extra["mask"].dtype == torch.bool
            h, bias = h * extra["scale"], extra["mask"].float()
        return self.head(h)


def plural(mode, batchnorm, net=PluralNet):
    """Recomputed blocks returning ``(hidden, None, {...})`` (or ``net``'s): the unsharded
    model's gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make(net, batchnorm=batchnorm)
    sharded, buffers, plan = _setup(model, type(model.blocks[0]), recompute=True)
    apply = fs.schedule(model, plan)
    batch = tokens(rank)
    grads = _grads(mode, lambda p: lm_loss(apply(p, batch, buffers=buffers), batch), sharded)
    reference = make(net, batchnorm=batchnorm)
    _, ref, _ = reference_step(reference, [tokens(r) for r in range(world)])
    return _err(grads, ref)


@pytest.mark.parametrize("batchnorm", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_that_are_not_tensors(world2, mode, batchnorm):
    """With BatchNorm the group runs through funcshard's Function under plain autograd too;
    without, through torch.utils.checkpoint."""
    assert max(world2.run(plural, mode, batchnorm)) < 1e-6


class PassingOn(Plural):
    """A block that returns an input as it came, next to its output (T5's blocks return the
    position bias they are given)."""

    def forward(self, x, bias):
        return super().forward(x, bias)[0], bias


class PassingOnNet(PluralNet):
    def __init__(self, batchnorm: bool, d=8) -> None:
        super().__init__(d=d)
        self.blocks = nn.ModuleList(PassingOn(d, batchnorm) for _ in range(2))

    def forward(self, tokens):
        h = self.embed(tokens)
        bias = h.mean(-1, keepdim=True)
        for block in self.blocks:
            h, bias = block(h, bias)
        return self.head(h)


@pytest.mark.parametrize("batchnorm", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_an_input_returned_as_it_came(world2, mode, batchnorm):
    assert max(world2.run(plural, mode, batchnorm, PassingOnNet)) < 1e-6
