"""ZeRO-2 for replicated parameters: ``fs.value_and_grad(..., grad_placements=
fs.optim.state_placements)`` reduce-scatters their gradients straight into the layout of
``fs.optim.shard_state``'s state. Checked against ``torch.optim.AdamW`` on the unsharded model on
the global batch (DDP on 2 ranks, HSDP on 4; through ``unshard`` and ``schedule``), and against
ZeRO-1 (the same model without ``grad_placements``): the same parameters, reduce-scatters of the
same sizes where ZeRO-1 all-reduces (half the bytes of a ring all-reduce), no all-reduce left."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import funcshard as fs

from _checks import raises
from _comm import Collectives
from _mesh import mesh

optim = fs.optim


class Net(nn.Module):
    """Uneven shapes (7 rows over 2 or 4 ranks), and a 0-d parameter (no dim to shard)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def zero2_vs_torch(mesh_shape, via: str, steps: int = 3):
    m, rank, world = mesh(*mesh_shape), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    full, _ = fs.extract(model)
    model.to("meta")
    place = Replicate() if len(mesh_shape) == 1 else None  # DDP; or HSDP (Replicate, Shard(0))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(nn.Linear)))

    def loss(p, x, y):
        out = apply(p, x) if via == "schedule" else fs.functional_call(model, fs.unshard(p), (x,))
        return F.mse_loss(out, y)

    opt = optim.shard_state(optim.adamw(0.01, weight_decay=0.1))
    runs = {}
    for name, placements in (("zero2", optim.state_placements), ("zero1", None)):
        params = fs.shard(full, m, place)
        state, errs, sent, where = opt.init(params), [], [], []
        vg = fs.value_and_grad(loss, grad_placements=placements)
        for step in range(steps):
            with Collectives() as rec:
                _, grads = vg(params, *_batch(step, rank))
            sent.append(sorted((k, n) for k, _, n in rec.sent if k != "all_gather"))
            where.append({k: tuple(g.placements) for k, g in grads.items()})
            params, state = optim.step(opt, params, grads, state)
            errs.append({k: v.full_tensor().detach().clone() for k, v in params.items()})
        runs[name] = (errs, sent, where)
    ref_params = []
    for step in range(steps):
        batches = [_batch(step, r) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()  # the unsharded model on the global batch
        ref_opt.step()
        ref_params.append({k: v.detach().clone() for k, v in ref.named_parameters()})
    out = {}
    for name, (params_by_step, sent, where) in runs.items():
        err = max(
            (p[k] - r[k]).abs().max().item()
            for p, r in zip(params_by_step, ref_params, strict=True)
            for k in r
        )
        out[name] = (err, sent, where)
    return out


@pytest.mark.parametrize(
    ("world", "mesh_shape", "via"),
    [("world2", (2,), "unshard"), ("world2", (2,), "schedule"), ("world4", (2, 2), "unshard"),
     ("world4", (2, 2), "schedule")],
)  # fmt: skip
def test_zero2_is_torch_adamw_on_the_unsharded_model(request, world, mesh_shape, via):
    for found in request.getfixturevalue(world).run(zero2_vs_torch, mesh_shape, via):
        (err2, sent2, where2), (err1, sent1, _) = found["zero2"], found["zero1"]
        assert err2 < 1e-6 and err1 < 1e-6, (err2, err1)
        for placements in where2:  # the state's layout: replicated dims shard a free dim
            assert placements["a.weight"][0] == Shard(0 if len(mesh_shape) == 1 else 1)
            assert placements["scale"] == (Replicate(),) * len(mesh_shape)  # none free
            # HSDP's biases have no free dim either: (Replicate(), Shard(0)), as the state's
            hsdp = len(mesh_shape) == 2
            assert placements["a.bias"][0] == (Replicate() if hsdp else Shard(0))
        for s2, s1 in zip(sent2, sent1, strict=True):
            if len(mesh_shape) == 1:  # DDP: ZeRO-1 all-reduces all 74 numbers
                assert {k for k, _ in s1} == {"all_reduce"} and sum(n for _, n in s1) == 74
                # ZeRO-2 reduce-scatters them instead, rows padded to a multiple of 2 (88);
                # only the 0-d parameter, with no dim to shard, is still all-reduced
                assert [n for k, n in s2 if k == "all_reduce"] == [1], s2
                assert sum(n for k, n in s2 if k == "reduce_scatter") == 88, s2
            # bytes each rank sends (ring algorithms, groups of 2): a reduce-scatter half its
            # input, an all-reduce all of it
            assert _wire(s2) < _wire(s1), (s2, s1)


def _wire(sent) -> float:
    return sum(n / 2 if k == "reduce_scatter" else n for k, n in sent)


def zero2_equals_the_default():
    """The gradients, seen whole, are those of the default path: a leaf gathered twice, one
    used as a DTensor too, an unused one, "weighted" with uneven counts; bad input."""
    m, rank = mesh(2), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(5, 3, generator=g) for k in ("w", "v", "unused")}
    x = torch.randn(3, generator=torch.Generator().manual_seed(1 + rank))

    def loss(p):
        once = fs.unshard(p, grad_reduce="weighted", count=(3, 1)[rank])
        twice = fs.unshard({"w": p["w"]})["w"]
        return (once["w"] @ x).sum() + (twice @ x).pow(2).sum() + p["v"].to_local().sum()

    params = fs.shard(full, m, Replicate())
    default = fs.grad(loss)(params)
    zero2 = fs.grad(loss, grad_placements=optim.state_placements)(params)
    err = max((zero2[k].full_tensor() - default[k].full_tensor()).abs().max().item() for k in full)
    placed = all(zero2[k].placements == (Shard(0),) for k in full)
    zero2_of = fs.grad(loss, sync_grads=False, grad_placements=optim.state_placements)
    wrong = fs.grad(loss, grad_placements=lambda path, p: (Shard(2),))
    bad = {
        "sync_grads": raises(lambda: zero2_of(params), NotImplementedError, "sync_grads=False"),
        "refine": raises(lambda: wrong(params), ValueError, "value_and_grad: the grad_placements",
                         "do not refine its placements"),
    }  # fmt: skip
    return err, placed, bad


def test_zero2_equals_the_default_path(world2):
    for err, placed, bad in world2.run(zero2_equals_the_default):
        assert err < 1e-6 and placed
        assert bad == {"sync_grads": None, "refine": None}
