"""The main job: a small causal language model trained with funcshard on 2 CPU ranks.

Run with ``make train`` (``torchrun --standalone --nproc-per-node 2 examples/train.py``).
Parameters are sharded across the ranks (ZeRO-3). Each step follows an explicit plan: one
transformer block's parameters gathered at a time (the next one prefetched), freed after its
forward and gathered again for its backward, its gradients reduce-scattered (averaged over
ranks) as soon as its backward ends. AdamW then updates the shards with ``torch.optim``'s
functional kernel.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.adamw import adamw

import funcshard as fs


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def batch(step: int, rank: int, size: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences of a fixed affine recurrence with a random start: learnable, never repeated."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    steps = torch.arange(length)
    return (start * 7**steps + 3 * (7**steps - 1) // 6) % vocab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    torch.manual_seed(0)  # every rank builds the same initial model
    vocab, length = 61, 16
    model = LM(vocab, args.width, 4, args.layers, length)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh)
    example = batch(0, rank, 8, length, vocab)
    plan = fs.plan(model, fs.policy.by_type(Block), example_args=(example,))
    model.to("meta")  # the module is now only a recipe; its weights live in `sharded`
    apply = fs.schedule(model, plan)

    def loss_fn(p, tokens):
        logits = apply(p, tokens, buffers=buffers)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    keys = list(sharded)
    moments = (
        [torch.zeros_like(sharded[k]) for k in keys],
        [torch.zeros_like(sharded[k]) for k in keys],
    )
    steps = [torch.tensor(0.0) for _ in keys]
    n = sum(p.numel() for p in params.values())
    if rank == 0:
        print(
            f"funcshard: {n} parameters sharded over {mesh.size()} ranks "
            f"({sum(sharded[k].to_local().numel() for k in keys)} on rank 0)"
        )
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss, grads = fs.value_and_grad(loss_fn)(sharded, batch(step, rank, 8, length, vocab))
        with torch.no_grad():
            adamw(
                [sharded[k] for k in keys],
                [grads[k] for k in keys],
                *moments,
                [],
                steps,
                foreach=False,
                capturable=False,
                differentiable=False,
                fused=None,
                grad_scale=None,
                found_inf=None,
                amsgrad=False,
                beta1=0.9,
                beta2=0.95,
                lr=args.lr,
                weight_decay=0.01,
                eps=1e-8,
                maximize=False,
            )
        mean = loss.clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(
                f"step {step:3d}  loss {mean.item() / mesh.size():.4f}  "
                f"({(time.perf_counter() - t0) * 1e3:.0f} ms)",
                flush=True,
            )
    final = mean.item() / mesh.size()
    if rank == 0:
        print(f"done: loss {final:.4f} (uniform guess: {math.log(vocab):.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
