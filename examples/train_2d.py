"""FSDP x tensor parallel with funcshard: torchtitan's 2-D recipe on a small Llama-style model.

    torchrun --standalone --nproc-per-node 4 examples/train_2d.py --dp 2 --tp 2

The recipe, as in torchtitan: one ``(dp, tp)`` mesh; each block parallelized on ``mesh["tp"]``
(attention heads and the SwiGLU hidden units split column-wise, the output projections
row-wise); then ``fs.extract`` and ``fs.shard(params, mesh["dp"])``, which shards every
parameter over dp on top of its TP placement (FSDP2's 2-D layout). ``fs.schedule`` runs one
block at a time, gathering over dp only; TP's all-reduces happen inside the blocks. AdamW with
global-norm clipping updates the shards in place. The data is a learnable pattern (each token
is an affine function of the previous one, modulo the vocabulary), the same global batch for
every layout: a run on ``--dp 4 --tp 1`` gives the same losses as ``--dp 2 --tp 2``.
``main(argv)`` also runs inside a process group that already exists (``fs.testing``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import funcshard as fs


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False) for _ in "qkvo")

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: this rank's heads under tensor parallelism (column-wise wq, wk, wv)
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = (
            nn.Linear(width, hidden, bias=False),
            nn.Linear(width, hidden, bias=False),
        )
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention = Attention(width, heads)
        self.feed_forward = SwiGLU(width, 4 * width)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# torchtitan's plan for a block, without sequence parallelism
TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def batch(step: int, size: int, context: int, vocab: int) -> torch.Tensor:
    """``[size, context + 1]`` tokens: ``t[i + 1] = (5 * t[i] + 3) % vocab`` from random starts."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(vocab, (size, 1), generator=g)
    steps = [start]
    for _ in range(context):
        steps.append((5 * steps[-1] + 3) % vocab)
    return torch.cat(steps, dim=1)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="sequences per step over all dp ranks")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; return the global-batch loss of every step (the same on every rank)."""
    args = parse(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if args.dp * args.tp != dist.get_world_size():
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} != {dist.get_world_size()} ranks")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same model on every rank
    model = Llama(args.vocab, args.width, args.depth, args.heads)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
    params, _ = fs.extract(model)
    sharded = fs.shard(params, mesh["dp"])  # dp on top of the TP placements
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(Block)))
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(args.lr))
    state = opt.init(sharded)

    def loss_fn(p, tokens):
        logits = apply(p, tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    per_rank, dp_rank = args.batch // args.dp, mesh["dp"].get_local_rank()
    losses = []
    for step in range(args.steps):
        tokens = batch(step, args.batch, args.context, args.vocab)
        mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]  # tp ranks: the same rows
        value, grads = fs.value_and_grad(loss_fn)(sharded, mine)
        sharded, state = fs.optim.step(opt, sharded, grads, state)
        dist.all_reduce(value)  # mean over dp of the ranks' losses: the global-batch loss
        losses.append(value.item() / dist.get_world_size())
        if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
    if "RANK" in os.environ:
        dist.destroy_process_group()
