"""fs.optim on sharded trees against torch.optim: FSDP2 + AdamW + clip_grad_norm_ + a schedule
over 20 steps; SGD/Adam/AdamW/masks on the same DTensor shards; the global norm against a hand
computation (uneven shards, a 0-d parameter, HSDP); state placements and DCP; memory; leaks."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs
from funcshard._runtime._profiling import peak_bytes
from funcshard._trees._tree import flatten

from _checks import raises
from _comm import counts
from _mesh import mesh
from _models import lm_loss, tokens

optim = fs.optim


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPLM(nn.Module):
    """A small LM whose every parameter gets a meaningful gradient (Adam divides by the
    gradient's size, so a parameter with a ~1e-9 rounding-noise gradient, as an attention key
    bias has, would turn that noise into lr-sized steps on both sides)."""

    def __init__(self, vocab=37, d=16, layers=2, max_len=8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, t):
        h = self.embed(t) + self.pos[: t.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Small(nn.Module):
    """Uneven shards (7 and 3 rows over 2 or 4 ranks, one of them empty) and a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.out = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x)))) * self.scale


def _small(mesh_shape):
    torch.manual_seed(0)
    model = Small()
    params, _ = fs.extract(model)
    model.to("meta")

    def loss_fn(p, x, y):
        return F.mse_loss(fs.functional_call(model, fs.unshard(p), (x,)), y)

    return fs.shard(params, mesh(*mesh_shape)), fs.value_and_grad(loss_fn)


def _data(step: int):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def _copy(tree):
    return {k: v.detach().clone().requires_grad_() for k, v in tree.items()}


def _warmup_cosine(step, warmup=5, total=20, floor=0.1):
    """The LambdaLR factor, written independently of fs.optim's schedules."""
    if step < warmup:
        return step / warmup
    t = (step - warmup) / (total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


# --- FSDP2 + torch.optim.AdamW + clip_grad_norm_ + LambdaLR, 20 steps --------------------------


def fsdp2_adamw(steps):
    rank, m = dist.get_rank(), mesh(dist.get_world_size())
    torch.manual_seed(0)
    ref = MLPLM()
    for block in ref.blocks:
        fully_shard(block, mesh=m)
    fully_shard(ref, mesh=m)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, _warmup_cosine)

    torch.manual_seed(0)
    model = MLPLM()
    params, _ = fs.extract(model)
    model.to("meta")
    lr = optim.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 20, end_value=1e-3)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr, weight_decay=0.1))
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(MLPBlock)))
    # two funcshard runs: donated step with fs.schedule; pure update with fs.unshard
    runs = {
        "step": (lambda p, b: lm_loss(apply(p, b), b), fs.shard(params, m)),
        "pure": (
            lambda p, b: lm_loss(fs.functional_call(model, fs.unshard(p), (b,)), b),
            fs.shard(params, m),
        ),
    }
    states = {k: opt.init(p) for k, (_, p) in runs.items()}
    errs = {k: {"loss": 0.0, "norm": 0.0} for k in runs}
    for step in range(steps):
        batch = tokens(rank, step=step)
        ref_loss = lm_loss(ref(batch), batch)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).full_tensor()
        topt.step()
        topt.zero_grad()
        sched.step()
        for k, (loss_fn, p) in runs.items():
            loss, grads = fs.value_and_grad(loss_fn)(p, batch)
            if k == "step":
                p, states[k] = optim.step(opt, p, grads, states[k])
            else:
                updates, states[k] = opt.update(grads, states[k], p)
                p = optim.apply_updates(p, updates)
            runs[k] = (loss_fn, p)
            e = errs[k]
            e["loss"] = max(e["loss"], abs(loss.item() - ref_loss.item()))
            e["norm"] = max(e["norm"], abs(states[k][0].norm.item() - ref_norm.item()))
    for k, (_, p) in runs.items():
        errs[k]["params"] = max(
            (p[n].to_local() - r.to_local()).abs().max().item()
            for n, r in ref.named_parameters()
            if r.to_local().numel()
        )
        errs[k]["count"] = int(states[k][1].count)
    return errs


def test_adamw_clip_warmup_cosine_matches_fsdp2_torch_optim(world2):
    for rank in world2.run(fsdp2_adamw, 20):
        for errs in rank.values():
            assert errs["count"] == 20
            assert errs["loss"] < 1e-5 and errs["norm"] < 1e-5 and errs["params"] < 1e-5, rank


# --- the same DTensor shards: fs.optim vs torch.optim (set_grads + optimizer.step()) ----------

_2D = ["inp.weight", "out.weight"]
CASES = {
    "sgd": (
        lambda: optim.sgd(0.1),
        lambda p: torch.optim.SGD(p.values(), lr=0.1),
    ),
    "sgd momentum": (
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p.values(), lr=0.1, momentum=0.9),
    ),
    "sgd nesterov foreach": (
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, foreach=True),
        lambda p: torch.optim.SGD(p.values(), lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    ),
    "sgd dampening weight decay": (
        lambda: optim.sgd(0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
        lambda p: torch.optim.SGD(
            p.values(), lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01
        ),
    ),
    "adam": (
        lambda: optim.adam(0.05, betas=(0.8, 0.9), weight_decay=0.01),
        lambda p: torch.optim.Adam(p.values(), lr=0.05, betas=(0.8, 0.9), weight_decay=0.01),
    ),
    "adamw fused": (
        lambda: optim.adamw(0.05, weight_decay=0.1, fused=True),
        lambda p: torch.optim.AdamW(p.values(), lr=0.05, weight_decay=0.1, fused=True),
    ),
    "adamw fused counts beside the parameters": (
        lambda: optim.adamw(0.05, weight_decay=0.1, fused=True, capturable=True),
        lambda p: torch.optim.AdamW(p.values(), lr=0.05, weight_decay=0.1, fused=True),
    ),
    "adam fused mask": (
        lambda: optim.adam(0.05, weight_decay=0.2, mask=optim.at_least_2d, fused=True),
        lambda p: torch.optim.Adam(_groups(p, 0.2), lr=0.05, fused=True),
    ),
    "adamw foreach": (
        lambda: optim.adamw(0.05, foreach=True),
        lambda p: torch.optim.AdamW(p.values(), lr=0.05, foreach=True),
    ),
    "adamw mask predicate": (
        lambda: optim.adamw(0.05, weight_decay=0.2, mask=optim.at_least_2d),
        lambda p: torch.optim.AdamW(_groups(p, 0.2), lr=0.05),
    ),
    "adamw mask tree": (
        lambda: optim.adamw(0.05, weight_decay=0.2, mask={k: k in _2D for k in _KEYS}),
        lambda p: torch.optim.AdamW(_groups(p, 0.2), lr=0.05),
    ),
    "masked decay + sgd": (
        lambda: optim.chain(
            optim.masked(optim.add_decayed_weights(0.05), optim.at_least_2d),
            optim.sgd(0.1, momentum=0.9),
        ),
        lambda p: torch.optim.SGD(_groups(p, 0.05), lr=0.1, momentum=0.9),
    ),
    "clip + adamw schedule": (
        lambda: optim.chain(
            optim.clip_by_global_norm(0.3),
            optim.adamw(optim.linear_schedule(0.0, 0.05, 2), weight_decay=0.1),
        ),
        lambda p: torch.optim.AdamW(p.values(), lr=0.05, weight_decay=0.1),
    ),
}
_KEYS = ["inp.weight", "inp.bias", "norm.weight", "norm.bias", "out.weight", "out.bias", "scale"]


def _groups(params, weight_decay):
    decay = [p for k, p in params.items() if k in _2D]
    rest = [p for k, p in params.items() if k not in _2D]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0}]


def _diff(a: DTensor, b: DTensor) -> float:
    a, b = a.to_local(), b.to_local()
    return (a - b).abs().max().item() if a.numel() else 0.0


def same_shards(case, mesh_shape, steps=4):
    """``steps`` steps of fs.optim (donated and pure) and of torch.optim on copies of the same
    shards, each with its own gradients from fs.value_and_grad: max differences per step."""
    make_fs, make_torch = CASES[case]
    clip = case.startswith("clip")
    sharded, vg = _small(mesh_shape)
    theirs = _copy(sharded)
    topt = make_torch(theirs)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, lambda s: min(s / 2, 1.0)) if clip else None
    opt = make_fs()
    ours = {"step": _copy(sharded), "pure": _copy(sharded)}
    states = {k: opt.init(p) for k, p in ours.items()}
    out = []
    for step in range(steps):
        x, y = _data(step)
        _, grads = vg(theirs, x, y)
        optim.set_grads(theirs, grads)
        norm = torch.nn.utils.clip_grad_norm_(theirs.values(), 0.3) if clip else None
        topt.step()
        if sched is not None:
            sched.step()
        errs = {}
        for k in ours:
            _, grads = vg(ours[k], x, y)
            if k == "step":
                ours[k], states[k] = optim.step(opt, ours[k], grads, states[k])
            else:
                updates, states[k] = opt.update(grads, states[k], ours[k])
                ours[k] = optim.apply_updates(ours[k], updates)
            errs[k] = max(_diff(ours[k][n], theirs[n]) for n in theirs)
            assert all(ours[k][n].placements == theirs[n].placements for n in theirs)
            if clip:
                errs[k + " norm"] = abs(states[k][0].norm.item() - norm.full_tensor().item())
        out.append(errs)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_same_shards_as_torch_optim(world2, case):
    for rank in world2.run(same_shards, case, (2,)):
        _check_same(case, rank)


def _check_same(case, rank):
    for errs in rank:
        # the same kernels on the same numbers; the global norm is summed in another order
        # than clip_grad_norm_'s, which may change its last bit
        assert errs["step"] <= (1e-6 if "clip" in case else 0), (case, rank)
        assert errs["pure"] < 1e-6, (case, rank)  # see [Note: updates as differences]
        assert errs.get("step norm", 0) < 1e-6 and errs.get("pure norm", 0) < 1e-6, rank


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_same_shards_as_torch_optim_4_ranks(world4, mesh_shape):
    for case in ["sgd momentum", "clip + adamw schedule"]:
        for rank in world4.run(same_shards, case, mesh_shape, 3):
            _check_same(case, rank)


def frozen_and_mixed(capturable: bool, steps: int = 6):
    """fs.optim.adamw(fused=True) and torch.optim.AdamW(fused=True) on the same DTensor shards
    of two dtypes, with a parameter frozen (no gradient) for two steps and gradients made two
    ways: around the parameter's own spec, as fs.value_and_grad returns them, and by
    DTensor.from_local (specs of their own): max difference of the parameters per step."""
    full = {
        "a": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        "b": torch.randn(6, generator=torch.Generator().manual_seed(2)),
        "c": torch.randn(4, 4, generator=torch.Generator().manual_seed(3)).bfloat16(),
        "d": torch.randn(5, 2, generator=torch.Generator().manual_seed(4)),
    }
    ours = fs.shard(full, mesh(2))
    theirs = _copy(ours)
    topt = torch.optim.AdamW(theirs.values(), lr=0.05, weight_decay=0.1, fused=True)
    opt = optim.adamw(0.05, weight_decay=0.1, fused=True, capturable=capturable)
    state = opt.init(ours)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same on every rank
        weights = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}

        def loss(q, weights=weights):
            full_q = fs.unshard(q)
            return sum((full_q[k].float() * w).sum() for k, w in weights.items())

        _, grads = fs.value_and_grad(loss)(ours)  # placed around the parameters' specs
        if step % 2:
            grads = {
                k: DTensor.from_local(
                    v.to_local().clone(),
                    v.device_mesh,
                    v.placements,
                    shape=v.shape,
                    stride=v.stride(),
                )
                for k, v in grads.items()
            }
        if step in (2, 3):
            grads["b"] = None
        for k, t in theirs.items():
            t.grad = None if grads[k] is None else grads[k].detach().clone()
        topt.step()
        ours, state = optim.step(opt, ours, grads, state)
        out.append(max(_diff(ours[k].float(), theirs[k].float()) for k in ours))
    return out


@pytest.mark.parametrize("capturable", [False, True])
def test_fused_adamw_frozen_and_mixed_dtypes_as_torch_optim(world2, capturable):
    """Bit for bit, also where fs.optim cannot take its one-list path (two dtypes, a frozen
    leaf, gradients that do not share their parameter's spec)."""
    for rank in world2.run(frozen_and_mixed, capturable):
        assert rank == [0.0] * 6, rank


# --- the global norm ------------------------------------------------------------------------


def global_norm_vs_hand(mesh_shape):
    sharded, vg = _small(mesh_shape)
    _, grads = vg(sharded, *_data(0))
    full = torch.cat([g.full_tensor().double().flatten() for g in grads.values()])
    with CommDebugMode() as comm:
        norm = optim.global_norm(grads)
    clipped, _ = optim.clip_by_global_norm(0.01).update(grads, optim.ClipState(norm), None)
    coef = 0.01 / (full.norm() + 1e-6)
    clip_err = max(
        (clipped[k].full_tensor().double() - grads[k].full_tensor().double() * coef).abs().max()
        for k in grads
    ).item()
    return abs(norm.item() - full.norm().item()) / full.norm().item(), counts(comm), clip_err


@pytest.mark.parametrize(
    ("shape", "world"), [((2,), "world2"), ((4,), "world4"), ((2, 2), "world4")]
)
def test_global_norm_counts_each_element_once(request, shape, world):
    for rel, comm, clip_err in request.getfixturevalue(world).run(global_norm_vs_hand, shape):
        assert rel < 1e-6 and clip_err < 1e-7
        assert comm == {"all_reduce": 1}


# --- state: placements, torch.distributed.checkpoint ----------------------------------------


def state_and_dcp(path):
    sharded, vg = _small((2,))
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.01))
    state = opt.init(sharded)
    _, grads = vg(sharded, *_data(0))
    sharded, state = optim.step(opt, sharded, grads, state)
    adam_state = state[1]
    placed = all(
        isinstance(t, DTensor) and t.placements == sharded[k].placements and t.shape == p.shape
        for tree in (adam_state.mu, adam_state.nu)
        for (k, t), p in zip(tree.items(), sharded.values(), strict=True)
    )
    paths, leaves, _ = flatten(state)
    dcp.save(dict(zip(paths, leaves, strict=True)), checkpoint_id=path)
    fresh = opt.init(sharded)
    paths, leaves, _ = flatten(fresh)
    loaded = dict(zip(paths, leaves, strict=True))
    dcp.load(loaded, checkpoint_id=path)
    same = all(
        torch.equal(_local(a), _local(b))
        for a, b in zip(flatten(state)[1], loaded.values(), strict=True)
    )
    return placed, same, int(loaded[paths[1]])


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def test_state_is_placed_like_params_and_checkpoints(world2, tmp_path):
    for placed, same, count in world2.run(state_and_dcp, str(tmp_path / "ckpt")):
        assert placed and same and count == 1


# --- memory and leaks -------------------------------------------------------------------------


def step_memory():
    torch.manual_seed(0)
    model = MLPLM(vocab=64, d=64)
    params, _ = fs.extract(model)
    model.to("meta")
    sharded = fs.shard(params, mesh(2))
    loss_fn = lambda p, b: lm_loss(fs.functional_call(model, fs.unshard(p), (b,)), b)
    _, grads = fs.value_and_grad(loss_fn)(sharded, tokens(dist.get_rank()))

    theirs = _copy(sharded)
    topt = torch.optim.AdamW(theirs.values(), lr=1e-3)

    def torch_step():
        optim.set_grads(theirs, _copy(grads))
        torch.nn.utils.clip_grad_norm_(theirs.values(), 1.0)
        topt.step()

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    box = {"p": _copy(sharded)}
    box["s"] = opt.init(box["p"])

    def fs_step(g):
        box["p"], box["s"] = optim.step(opt, box["p"], g, box["s"])

    torch_step(), fs_step(_copy(grads))  # torch.optim creates its state on the first step
    optim.set_grads(theirs, _copy(grads))
    theirs_peak, _ = peak_bytes(
        lambda: (torch.nn.utils.clip_grad_norm_(theirs.values(), 1.0), topt.step()),
        this_thread=True,
    )
    g = _copy(grads)
    ours_peak, _ = peak_bytes(lambda: fs_step(g), this_thread=True)
    u = {k: torch.zeros_like(v) for k, v in box["p"].items()}
    apply_peak, _ = peak_bytes(
        lambda: optim.apply_updates(box["p"], u, inplace=True), this_thread=True
    )
    return ours_peak, theirs_peak, apply_peak, len(sharded)


def test_donated_step_memory_is_torch_optims(world2):
    for ours, theirs, apply_peak, n in world2.run(step_memory):
        # the kernels take one float step scalar per parameter, which torch.optim keeps in its
        # state between steps and fs.optim makes for the call: no tensor-sized buffer more
        assert ours <= theirs + 4 * n + 64, (ours, theirs)
        assert apply_peak < 1024


def live_tensors(steps, donated):
    sharded, vg = _small((2,))
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(
            optim.warmup_cosine_decay_schedule(0.0, 0.01, 5, steps), mask=optim.at_least_2d
        ),
    )
    state = opt.init(sharded)
    counts_ = []
    for step in range(steps):
        _, grads = vg(sharded, *_data(step))
        if donated:
            sharded, state = optim.step(opt, sharded, grads, state)
        else:
            updates, state = opt.update(grads, state, sharded)
            sharded = optim.apply_updates(sharded, updates)
        del grads
        if step + 1 in (10, 25, 40):
            gc.collect()
            counts_.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    return counts_


@pytest.mark.parametrize("donated", [True, False])
def test_no_tensors_leak_over_40_steps(world2, donated):
    for counts_ in world2.run(live_tensors, 40, donated):
        # live tensors after 10, 25 and 40 steps never grow (they may shrink: the shared rank
        # process can free, during these steps, tensors that an earlier test left behind)
        assert counts_[2] <= counts_[1] <= counts_[0], counts_


# --- errors on sharded trees ------------------------------------------------------------------


def sharded_errors():
    sharded, vg = _small((2,))
    _, grads = vg(sharded, *_data(0))
    opt = optim.adamw(0.1)
    state = opt.init(sharded)
    plain = {k: g.to_local() for k, g in grads.items()}
    replicated = {k: g.redistribute(placements=[Replicate()]) for k, g in grads.items()}
    partial = DTensor.from_local(torch.ones(2), mesh(2), [Partial()])
    return [
        raises(
            lambda: opt.update(plain, state, sharded),
            TypeError,
            "is a plain tensor but the parameter is a DTensor",
        ),
        raises(
            lambda: opt.update(replicated, state, sharded),
            ValueError,
            "has shape and placements",
            "(Replicate(),), but the parameter has",
        ),
        raises(
            lambda: optim.global_norm({"a": grads["inp.weight"], "b": torch.ones(1)}),
            ValueError,
            "'b' is a plain tensor",
        ),
        raises(lambda: optim.global_norm({"p": partial}), ValueError, "'p' has placement P(sum)"),
        raises(
            lambda: optim.set_grads(sharded, {"inp.weight": None}), ValueError, "missing from grads"
        ),
    ]


def test_errors_on_sharded_trees(world2):
    for rank in world2.run(sharded_errors):
        assert rank == [None] * len(rank), rank


# --- apply_if_finite: a NaN in one rank's batch skips the step on every rank ----------------


def nan_on_one_rank(donated: bool):
    m = mesh(2)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(6, generator=g)}
    ours = fs.shard(full, m)
    theirs = {k: v.clone().requires_grad_() for k, v in full.items()}  # unsharded reference
    ref = torch.optim.AdamW(theirs.values(), lr=0.05)
    opt = optim.apply_if_finite(
        optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.05)), max_consecutive_errors=2
    )
    state = opt.init(ours)
    seen = []
    for step in range(6):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
        bad = step in (2, 3)  # a NaN in rank 1's gradients only
        mine = fs.shard(grads, m)
        if bad and rank == 1:
            mine["w"].to_local()[0, 0] = float("nan")
        if not bad:  # the reference skips those steps
            for k, t in theirs.items():
                t.grad = grads[k].clone()
            torch.nn.utils.clip_grad_norm_(theirs.values(), 1.0)
            ref.step()
        if donated:
            ours, state = optim.step(opt, ours, mine, state)
        else:
            updates, state = opt.update(mine, state, ours)
            ours = optim.apply_updates(ours, updates)
        seen.append((int(state.notfinite_count), bool(state.last_finite)))
    err = max(_diff(ours[k], fs.shard({k: t.detach()}, m)[k]) for k, t in theirs.items())
    # more than max_consecutive_errors in a row: applied anyway (as optax)
    strict = optim.apply_if_finite(optim.sgd(0.1), max_consecutive_errors=0)
    nan = fs.shard({"w": torch.full((4,), float("nan"))}, m)
    p, _ = optim.step(strict, fs.shard({"w": torch.ones(4)}, m), nan, strict.init(nan))
    return seen, int(state.total_notfinite), err, bool(torch.isnan(p["w"].full_tensor()).all())


@pytest.mark.parametrize("donated", [True, False])
def test_apply_if_finite_skips_a_step_with_a_nan_on_one_rank(world2, donated):
    for seen, total, err, applied in world2.run(nan_on_one_rank, donated):
        assert seen == [(0, True), (0, True), (1, False), (2, False), (0, True), (0, True)]
        assert total == 2 and applied
        assert err < 1e-6, err  # the clip norm is summed shard by shard: rounding differs


def frozen_for_a_while():
    """Sharded AdamW where one parameter has no gradient for 5 steps, against torch.optim.AdamW
    on the full tensors (which counts a step per parameter)."""
    m = mesh(2)
    g = torch.Generator().manual_seed(5)
    full = {"w": torch.randn(6, 4, generator=g), "late": torch.randn(6, generator=g)}
    ours = fs.shard(full, m)
    theirs = {k: v.clone().requires_grad_() for k, v in full.items()}
    ref = torch.optim.AdamW(theirs.values(), lr=0.05, weight_decay=0.1)
    opt = optim.adamw(0.05, weight_decay=0.1)
    state = opt.init(ours)
    for step in range(8):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
        grads["late"] = None if step < 5 else grads["late"]
        for k, t in theirs.items():
            t.grad = None if grads[k] is None else grads[k].clone()
        ref.step()
        given = {k: None if v is None else fs.shard({k: v}, m)[k] for k, v in grads.items()}
        ours, state = optim.step(opt, ours, given, state)
    expected = fs.shard({k: t.detach() for k, t in theirs.items()}, m)
    return max(_diff(ours[k], expected[k]) for k in full), float(state.steps["late"])


def test_sharded_adamw_counts_steps_per_leaf_as_torch_optim(world2):
    for err, late in world2.run(frozen_for_a_while):
        assert err == 0 and late == 3.0


def test_fused_adamw_compiles_whole():
    """fused=True inside torch.compile(fullgraph=True): torch keeps its fused kernel out of
    traces, so the traced step runs the unfused arithmetic; the update equals eager fused's."""
    torch.manual_seed(0)
    params = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = fs.optim.adamw(1e-2, fused=True)
    want, _ = opt.update(grads, opt.init(params), params)
    compiled = torch.compile(opt.update, fullgraph=True, backend="aot_eager")
    got, state = compiled(grads, opt.init(params), params)
    for k in params:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6)
    assert int(state.count) == 1
