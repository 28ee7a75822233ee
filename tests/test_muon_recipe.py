"""The Muon + AdamW recipe (fs.optim.muon_adamw, fs.optim.partition) against torch.optim.Muon +
torch.optim.AdamW on the unsharded model, with clipping and schedules; checkpoints (exact resume,
resharding from 2 to 4 ranks); a partition that leaves a parameter without a transformation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import funcshard as fs
from funcshard._trees._tree import flatten

from _checks import raises
from _mesh import mesh

optim = fs.optim
VOCAB, D = 37, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 30)  # 30 rows: uneven over 4 ranks
        self.down = nn.Linear(30, D)  # rows < cols

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(8, D) * 0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, t):
        h = self.embed(t) + self.pos[: t.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def is_muon(path: str, p: torch.Tensor) -> bool:
    return optim.hidden_matrices(path, p) and path != "pos"  # a position table named otherwise


def _factor(step: int) -> float:
    return min((step + 1) / 3, 1.0) * (0.5 + 0.5 * math.cos(math.pi * step / 10))


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, VOCAB, (4, 8), generator=g)
    model.zero_grad()
    logits = model(t)
    F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), t[:, 1:].reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _recipe(clip: bool, schedule: bool):
    muon_lr = (lambda s: 0.02 * _factor(s)) if schedule else 0.02
    adamw_lr = (lambda s: 3e-3 * _factor(s)) if schedule else 3e-3
    recipe = optim.muon_adamw(muon_lr, adamw_lr, is_muon=is_muon, adjust_lr_fn="match_rms_adamw")
    return optim.chain(optim.clip_by_global_norm(0.5), recipe) if clip else recipe


def against_torch(clip: bool, schedule: bool, steps: int = 4):
    """The recipe on shards vs torch.optim.Muon + AdamW (two parameter lists) on the unsharded
    model, both given the unsharded model's gradients: max difference per step."""
    torch.manual_seed(0)
    model = Net()
    params, _ = fs.extract(model)
    ours = fs.shard(params, mesh(dist.get_world_size()))
    names = dict(model.named_parameters())
    hidden = [p for n, p in names.items() if is_muon(n, p)]
    rest = [p for n, p in names.items() if not is_muon(n, p)]
    topts = [
        torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=3e-3),
    ]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _factor) for o in topts] if schedule else []
    opt = _recipe(clip, schedule)
    state = opt.init(ours)
    errs = []
    for step in range(steps):
        grads = _grads(model, step)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for o in topts:
            o.step()
        for s in scheds:
            s.step()
        ours, state = optim.step(opt, ours, fs.shard(grads, mesh(dist.get_world_size())), state)
        errs.append(max((ours[n].full_tensor() - p.detach()).abs().max().item()
                        for n, p in names.items()))  # fmt: skip
    labels = sorted(n for n in names if n in flatten(_inner(state).inner["muon"].momentum)[0])
    return errs, labels


def _inner(state):
    return state[1] if isinstance(state, tuple) and not hasattr(state, "_fields") else state


@pytest.mark.parametrize(("clip", "schedule"), [(False, False), (True, True)])
def test_recipe_matches_torch_muon_and_adamw(world2, world4, clip, schedule):
    for world in (world2, world4):
        for errs, muon_leaves in world.run(against_torch, clip, schedule):
            assert muon_leaves == [f"blocks.{i}.{m}.weight" for i in (0, 1) for m in ("down", "up")]
            # the same kernels on the same numbers: bit for bit; with clipping, the global norm
            # adds its partial sums in another order than clip_grad_norm_ (last bit of the
            # scale), which Newton-Schulz's bfloat16 rounding may carry to a few 1e-5
            assert max(errs) <= (1e-4 if clip else 0), errs


# --- checkpoints ---------------------------------------------------------------------------


def _setup():
    torch.manual_seed(0)
    model = Net()
    params, _ = fs.extract(model)
    return model, fs.shard(params, mesh(dist.get_world_size()))


def _full(tree) -> dict[str, torch.Tensor]:
    paths, leaves, _ = flatten(tree)
    return {
        p: (x.full_tensor() if isinstance(x, DTensor) else x).clone()
        for p, x in zip(paths, leaves, strict=True)
    }


def save_and_resume(path: str):
    """2 steps, save, 2 steps; then load and take the same 2 steps: the full trees of both."""
    model, params = _setup()
    opt = _recipe(True, True)
    state = opt.init(params)
    m = mesh(dist.get_world_size())
    for step in range(2):
        params, state = optim.step(opt, params, fs.shard(_grads(model, step), m), state)
    fs.checkpoint.save(path, {"params": params, "opt": state})
    saved = _full({"params": params, "opt": state})
    for step in range(2, 4):
        params, state = optim.step(opt, params, fs.shard(_grads(model, step), m), state)
    straight = _full({"params": params, "opt": state})
    resumed = _load_and_step(path, 2)
    return saved, straight, resumed


def _load_and_step(path: str, steps: int):
    model, like = _setup()
    opt = _recipe(True, True)
    loaded = fs.checkpoint.load(path, {"params": like, "opt": opt.init(like)})
    params, state = loaded["params"], loaded["opt"]
    m = mesh(dist.get_world_size())
    out = [_full(loaded)]
    for step in range(2, 2 + steps):
        params, state = optim.step(opt, params, fs.shard(_grads(model, step), m), state)
    out.append(_full({"params": params, "opt": state}))
    return out


def test_checkpoint_exact_resume_and_reshard(world2, world4, tmp_path):
    path = str(tmp_path / "ckpt")
    saved, straight, (loaded, resumed) = world2.run(save_and_resume, path)[0]
    assert set(saved) == set(loaded) and any("muon" in k for k in saved)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # bit for bit
    # resharded onto 4 ranks: the same values, and the run goes on (the global norm's order of
    # additions differs with the ranks, so within rounding)
    loaded4, resumed4 = world4.run(_load_and_step, path, 2)[0]
    assert all(torch.equal(saved[k], loaded4[k]) for k in saved)
    for k in straight:
        torch.testing.assert_close(resumed4[k], straight[k], rtol=0, atol=1e-4)


# --- bad input -----------------------------------------------------------------------------


def test_partition_errors_name_the_parameter():
    params = {"w": torch.randn(4, 3), "norm.weight": torch.randn(4)}
    sgd = optim.sgd(0.1)
    problems = [
        raises(
            lambda: optim.partition({"a": sgd}, lambda p, x: "a" if x.dim() == 2 else None).init(
                params
            ),
            ValueError,
            "'norm.weight' has label None, which has no transformation",
        ),
        raises(
            lambda: optim.partition({"a": sgd}, {"w": "a", "norm.weight": "b"}).init(params),
            ValueError,
            "'norm.weight' has label 'b'",
        ),
        raises(
            lambda: optim.muon_adamw(0.1, 0.1, is_muon=lambda p, x: True).init(params),
            ValueError,
            "'norm.weight' has shape [4]",
        ),
        raises(lambda: optim.partition({"a": 0.1}, lambda p, x: "a"), TypeError, "'a'"),
    ]
    assert problems == [None] * len(problems), problems


def test_partition_pure_equals_donated_and_each_group_its_own():
    torch.manual_seed(0)
    params = {"w": torch.randn(5, 3), "b": torch.randn(5)}
    grads = {"w": torch.randn(5, 3), "b": torch.randn(5)}
    opt = optim.partition(
        {"m": optim.muon(0.1), "s": optim.sgd(0.5)}, lambda p, x: "m" if x.dim() == 2 else "s"
    )
    updates, _ = opt.update(grads, opt.init(params), params)
    pure = optim.apply_updates(params, updates)
    donated, state = optim.step(opt, {k: v.clone() for k, v in params.items()}, grads,
                                opt.init(params))  # fmt: skip
    torch.testing.assert_close(pure, donated, rtol=0, atol=1e-7)
    torch.testing.assert_close(donated["b"], params["b"] - 0.5 * grads["b"], rtol=0, atol=1e-7)
    assert set(state.inner) == {"m", "s"} and list(state.inner["m"].momentum) == ["w", "b"]
    assert state.inner["m"].momentum["b"] is None and state.inner["s"].count == 1
