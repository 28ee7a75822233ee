"""Ranks that average over different counts: an empty batch under
``grad_reduce="mean"`` is an error on every rank in the same call (and the ranks stay in step);
``grad_reduce="weighted"`` gives the gradient of the mean over the global batch, checked against
the unsharded model on the concatenated batches (uneven, one empty), through ``unshard``,
``schedule`` (tokens counted from labels of -100), DDP and HSDP layouts and ``reduce``, with the
same collectives as ``"mean"``; FSDP x TP counts the data-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs

from _checks import raises
from _mesh import mesh
from _models import meta_mlp


def _model():
    return meta_mlp(6, 5, 3, nn.Tanh)


def _batch(rank: int, sizes):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(sizes[rank], 6, generator=g), torch.randn(sizes[rank], 3, generator=g)


def _unsharded(params, model, batches):
    """The reference: the unsharded model's mean loss over the concatenated global batch."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    full = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = F.mse_loss(torch.func.functional_call(model.to_empty(device="cpu"), full, (x,)), y)
    return dict(zip(full, torch.autograd.grad(loss, list(full.values())), strict=True))


def _error(grads, ref) -> float:
    return max(float((grads[k].full_tensor() - ref[k]).abs().max()) for k in ref)


def empty_batch_under_mean():
    m, rank = mesh(2), dist.get_rank()
    model, params = _model()
    sharded = fs.shard(params, m)
    x, y = _batch(rank, (4, 0))  # rank 1: no samples

    def loss(p, x, y):
        return F.mse_loss(fs.functional_call(model, fs.unshard(p), (x,)), y)

    found = {}
    found["value_and_grad"] = raises(
        lambda: fs.value_and_grad(loss)(sharded, x, y),
        ValueError, "unshard: rank(s) [1] have an empty batch", "times 1/2", "'weighted'",
    )  # fmt: skip
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))
    found["schedule, .backward()"] = raises(
        lambda: apply(sharded, x).sum().backward(), ValueError, "schedule: rank(s) [1]"
    )
    found["count=0"] = raises(  # e.g. labels that are all -100: only the count can say it
        lambda: fs.value_and_grad(lambda p: fs.unshard(p, count=0 if rank else 4)["0.bias"].sum())(
            sharded
        ),
        ValueError, "rank(s) [1] have an empty batch",
    )  # fmt: skip
    with torch.no_grad():  # no gradient, nothing reduced: an empty batch is fine
        found["no_grad"] = tuple(apply(sharded, x).shape)
    # the ranks are still in step: the next call (equal counts) pairs with the same call
    full = _batch(rank, (4, 4))
    _, grads = fs.value_and_grad(loss)(sharded, *full)
    return found, {k: v.full_tensor() for k, v in grads.items()}, full


def test_an_empty_batch_under_mean_is_an_error_on_every_rank(world2):
    results = world2.run(empty_batch_under_mean)
    for found, _, _ in results:
        assert found == {
            "value_and_grad": None,
            "schedule, .backward()": None,
            "count=0": None,
            "no_grad": found["no_grad"],
        }
    assert [r[0]["no_grad"] for r in results] == [(4, 3), (0, 3)]
    model, params = _model()
    ref = _unsharded(params, model, [r[2] for r in results])  # equal batches: mean is right
    for _, grads, _ in results:
        assert max(float((grads[k] - ref[k]).abs().max()) for k in ref) < 1e-6


def weighted_unshard(sizes, placements):
    shape = (2, dist.get_world_size() // 2) if placements == "hsdp" else (2,)
    m, rank = mesh(*shape), dist.get_rank()
    model, params = _model()
    sharded = fs.shard(params, m, Replicate() if placements == "ddp" else None)
    batches = [_batch(r, sizes) for r in range(dist.get_world_size())]
    x, y = batches[rank]

    def loss(p, x, y, grad_reduce, count=None):
        full = fs.unshard(p, grad_reduce=grad_reduce, count=count)
        return F.mse_loss(fs.functional_call(model, full, (x,)), y)

    with CommDebugMode() as weighted_comms:
        value, grads = fs.value_and_grad(loss)(sharded, x, y, "weighted", len(x))
    equal = [_batch(r, (3,) * len(sizes)) for r in range(len(sizes))]
    with CommDebugMode() as mean_comms:
        fs.value_and_grad(loss)(sharded, *equal[rank], "mean")
    same = weighted_comms.get_comm_counts() == mean_comms.get_comm_counts()
    ref = _unsharded(params, model, batches)
    placed = all(grads[k].placements == sharded[k].placements for k in grads)
    return _error(grads, ref), bool(value.isnan()), same, placed


@pytest.mark.parametrize(
    ("world", "sizes", "placements"),
    [("world2", (5, 0), "fsdp"), ("world2", (2, 7), "fsdp"), ("world2", (1, 4), "ddp"),
     ("world2", (0, 3), "ddp"), ("world4", (1, 0, 4, 2), "hsdp")],
)  # fmt: skip
def test_weighted_is_the_unsharded_mean_over_the_global_batch(request, world, sizes, placements):
    results = request.getfixturevalue(world).run(weighted_unshard, sizes, placements)
    for rank, (err, nan, same, placed) in enumerate(results):
        assert err < 1e-6, (rank, err)
        assert nan == (sizes[rank] == 0)  # the value is the rank's own loss
        assert same and placed  # the collectives of "mean": no collective added


class TinyLM(nn.Module):
    """Takes ``labels`` as a Hugging Face model does, and returns the mean token loss."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(11, 4), nn.Linear(4, 11)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _tokens(rank: int):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    labels = ids.clone()
    labels[:, : 2 + 2 * rank] = -100  # prompt tokens masked: 9 and 2 tokens count
    if rank == 1:
        labels[0] = -100
    return ids, labels


def weighted_schedule():
    m, rank = mesh(2), dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    params, _ = fs.extract(model)
    data = [_tokens(r) for r in range(2)]
    ids = torch.cat([d[0] for d in data])
    labels = torch.cat([d[1] for d in data])
    loss = model(ids, labels)  # the unsharded model on the global batch
    ref = dict(zip(params, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    apply = fs.schedule(
        model.to("meta"), fs.plan(model, fs.policy.by_type(nn.Linear)), grad_reduce="weighted"
    )
    sharded = fs.shard(params, m)
    ids, labels = data[rank]
    count = (labels != -100).sum()  # a tensor: read with .item()
    _, grads = fs.value_and_grad(lambda p: apply(p, input_ids=ids, labels=labels, count=count))(
        sharded
    )
    missing = raises(lambda: apply(sharded, ids, labels), ValueError, "count=")
    return _error(grads, ref), int(count), missing


def test_weighted_schedule_counts_tokens_as_the_unsharded_model(world2):
    results = world2.run(weighted_schedule)
    assert [r[1] for r in results] == [9, 2]
    for err, _, missing in results:
        assert err < 1e-6 and missing is None


def weighted_reduce():
    m, rank = mesh(2), dist.get_rank()
    like = fs.shard({"w": torch.zeros(5, 3)}, m)
    full = {"w": torch.full((5, 3), float(rank + 1))}  # rank r's gradient of its mean loss
    out = fs.reduce(full, like, op="weighted", count=(3, 1)[rank])["w"].full_tensor()
    # rank 1 has no sample: its gradient (NaN here) must not count at all
    nan = {"w": torch.full((5, 3), torch.nan if rank else 2.0)}
    alone = fs.reduce(nan, like, op="weighted", count=(2, 0)[rank])["w"].full_tensor()
    return out, alone


def test_weighted_reduce_by_hand(world2):
    for out, alone in world2.run(weighted_reduce):
        torch.testing.assert_close(out, torch.full((5, 3), 3 / 4 * 1 + 1 / 4 * 2))
        torch.testing.assert_close(alone, torch.full((5, 3), 2.0))


def bad_counts():
    m, rank = mesh(2), dist.get_rank()
    sharded = fs.shard({"w": torch.ones(4, 2)}, m)

    def vg(**kw):
        return fs.value_and_grad(lambda p: fs.unshard(p, **kw)["w"].sum())(sharded)

    return {
        "no count": raises(lambda: vg(grad_reduce="weighted"), ValueError, "needs this rank's"),
        "sum": raises(lambda: vg(grad_reduce="sum", count=3), ValueError, "count=3 with"),
        "negative": raises(lambda: vg(grad_reduce="weighted", count=-1), ValueError, ">= 0"),
        "nan": raises(lambda: vg(grad_reduce="weighted", count=float("nan")), ValueError, ">= 0"),
        "all zero": raises(
            lambda: vg(grad_reduce="weighted", count=0), ValueError, "every rank's count is 0"
        ),
        "one rank": raises(  # rank 1 forgot the count: every rank raises, naming it
            lambda: vg(grad_reduce="weighted", count=None if rank else 2),
            ValueError,
            "rank 1 raised ValueError" if rank == 0 else "needs this rank's",
        ),
        "mode": raises(lambda: vg(grad_reduce="avg"), ValueError, "'weighted', got 'avg'"),
        "after": float(vg(grad_reduce="weighted", count=rank + 1)[1]["w"].full_tensor()[0, 0]),
    }


def test_bad_counts_are_errors_on_every_rank(world2):
    for found in world2.run(bad_counts):
        assert found == {**{k: None for k in found if k != "after"}, "after": 1.0}


def weighted_2d():
    """FSDP x TP: the weight's N sums the counts over the data-parallel ranks only (the tensor-
    parallel ranks of a data-parallel slot hold the same batch)."""
    from _tp import batch, dp_rank, loss, make, parallelized

    m, model = parallelized()
    sharded = fs.shard(fs.extract(model)[0], m["dp"])
    gx, gy = batch(0)  # 6 rows: data-parallel rank 0 takes 5, rank 1 takes 1
    rows = slice(0, 5) if dp_rank(m) == 0 else slice(5, 6)
    x, y = gx[rows], gy[rows]

    def loss_fn(p):
        full = fs.unshard(p, grad_reduce="weighted", count=len(x))
        return loss(fs.functional_call(model, full, (x,)), y)

    _, grads = fs.value_and_grad(loss_fn)(sharded)
    ref = make()
    loss(ref(gx), gy).backward()
    rp = dict(ref.named_parameters())
    return max((g.full_tensor() - rp[k].grad).abs().max().item() for k, g in grads.items())


def test_weighted_fsdp_x_tp_counts_data_parallel_ranks(world4):
    for err in world4.run(weighted_2d):
        assert err < 1e-5, err
