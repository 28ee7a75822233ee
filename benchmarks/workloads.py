"""The models the suite runs, each with its grouping, data and loss (a ``Workload``).

Every builder seeds torch, so every rank (and both frameworks) start from the same weights.
``quick=True`` gives a small version of the same shape for ``--quick`` and the smoke test.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from train_lm import LM, Block  # the main job's transformer


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, how it is grouped (the same modules for FSDP2's ``fully_shard`` and for
    ``fs.policy.by_type``), its per-rank batches and its loss. ``shards``: for a model that
    ``build`` makes on the meta device, ``shards(model, mesh) -> (sharded params, buffers)``, its
    initial values straight into shards (``fs.materialize``); ``None``: ``build`` makes the real
    tensors, which each framework shards itself."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    group_types: tuple[type[nn.Module], ...]
    batch: Callable[[int, int], tuple[torch.Tensor, ...]]  # (step, rank) -> inputs
    loss: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]
    shards: Callable[[nn.Module, Any], tuple[dict, dict]] | None = None

    def to(self, device: torch.device) -> Workload:
        """The same workload with model and batches on ``device``."""
        build, batch = self.build, self.batch
        return dataclasses.replace(
            self,
            build=lambda: build().to(device),
            batch=lambda step, rank: tuple(x.to(device) for x in batch(step, rank)),
        )


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return fn()

    return build


def _lm_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    (tokens,) = batch
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _mse(out: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out.float().square().mean()


def transformer(quick: bool = False, sequences: int = 2, layers: int | None = None) -> Workload:
    """The main job's language model (examples/train_lm.py): 8 blocks (or ``layers``), width
    512, 8 heads; ``sequences`` per rank per step."""
    depth, width, heads, vocab, seq, size = (
        (2, 64, 4, 128, 16, sequences) if quick else (8, 512, 8, 512, 64, sequences)
    )
    layers = layers or depth

    def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        return (torch.randint(0, vocab, (size, seq), generator=g),)

    return Workload(
        name="transformer",
        description=f"LM, {layers} blocks x {width} wide, {heads} heads, vocab {vocab}, "
        f"batch {size}x{seq} per rank; one group per block + the root",
        build=_seeded(lambda: LM(vocab, width, heads, layers, seq)),
        group_types=(Block,),
        batch=batch,
        loss=_lm_loss,
    )


class MLPBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def mlp(quick: bool = False) -> Workload:
    """Parameter-heavy: 8 residual blocks of 1024 -> 4096 -> 1024 (~67M parameters), a small
    batch (2 x 64 rows), so parameters, gradients and optimizer state dominate memory."""
    blocks, width, rows = (2, 64, 16) if quick else (8, 1024, 128)

    def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(rows, width, generator=torch.Generator().manual_seed(step + rank)),)

    return Workload(
        name="mlp",
        description=f"{blocks} residual MLP blocks {width} -> {4 * width} -> {width}, "
        f"{rows} rows per rank; one group per block",
        build=_seeded(lambda: nn.Sequential(*[MLPBlock(width, 4 * width) for _ in range(blocks)])),
        group_types=(MLPBlock,),
        batch=batch,
        loss=_mse,
    )


def linears(count: int, width: int, rows: int = 4, name: str = "") -> Workload:
    """``count`` groups of one ``Linear(width, width)`` + tanh: per-group overhead dominates."""

    def batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(rows, width, generator=torch.Generator().manual_seed(step + rank)),)

    def build() -> nn.Module:
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count)]
        )

    per_group = width * width + width
    return Workload(
        name=name or f"{count}x linear {width}",
        description=f"{count} groups of one Linear({width}, {width}) ({per_group} parameters "
        f"each), {rows} rows per rank",
        build=_seeded(build),
        group_types=(nn.Linear,),
        batch=batch,
        loss=_mse,
    )


def overhead_models(quick: bool = False) -> list[Workload]:
    """Many tiny groups (64 x 64x64 linears) and ~100 parameters per group (64 x 10x10)."""
    count = 8 if quick else 64
    return [
        linears(count, 64, name=f"{count} x linear 64x64"),
        linears(count, 10, name=f"{count} x linear 10x10"),
    ]


def meta_llama(layers: int, width: int, hidden: int, vocab: int, kv_width: int) -> nn.Module:
    """A Llama-shaped stack on the meta device (no memory): for plans and shards at scale."""
    with torch.device("meta"):
        return _Llama(layers, width, hidden, vocab, kv_width)


class _Attention(nn.Module):
    def __init__(self, width: int, kv_width: int, head_dim: int = 128) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_width, bias=False)  # grouped-query attention
        self.v = nn.Linear(width, kv_width, bias=False)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class LlamaBlock(nn.Module):
    def __init__(self, width: int, hidden: int, kv_width: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attn = _Attention(width, kv_width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _Llama(nn.Module):
    def __init__(self, layers: int, width: int, hidden: int, vocab: int, kv_width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, hidden, kv_width) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


# Llama-2-like shapes (layers, width, MLP hidden, vocab, key/value width), untied head:
# ~1.1B, 6.7B, 13B and 69B parameters. ``scale`` also varies the layer count of one shape.
LLAMA_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "1B": (16, 2048, 5632, 32000, 2048),
    "7B": (32, 4096, 11008, 32000, 4096),
    "13B": (40, 5120, 13824, 32000, 5120),
    "70B": (80, 8192, 28672, 32000, 1024),
}


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe(w: Workload) -> dict[str, Any]:
    model = w.build()
    return {"name": w.name, "description": w.description, "parameters": count(model)}
