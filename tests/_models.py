"""Small models and reference computations shared by the tests (run inside rank processes)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.out(torch.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Tied embedding/head, learned positions, LayerNorm, and a BatchNorm with running stats."""

    def __init__(self, vocab=37, d=16, heads=2, layers=2, max_len=8, batchnorm=True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.bn = nn.BatchNorm1d(d) if batchnorm else nn.Identity()
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        h = self.bn(self.norm(h).transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tokens(rank: int, batch: int = 3, length: int = 8, vocab: int = 37, step: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (batch, length), generator=g)


def make(cls=TinyLM, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return cls(**kw)


def reference_step(model: nn.Module, batches, loss_fn=lm_loss):
    """Mean over ``batches`` (one per rank) of each batch's loss, computed unsharded.

    Each batch runs on its own copy of the model, as each rank's BatchNorm sees only its own
    batch. Returns (mean loss, {fqn: grad}, [buffers after each batch]).
    """
    losses, grads, buffers = [], None, []
    for batch in batches:
        m = copy.deepcopy(model)
        loss = loss_fn(m(batch), batch)
        loss.backward()
        losses.append(loss.detach())
        g = {n: p.grad for n, p in m.named_parameters()}
        grads = g if grads is None else {n: _add(grads[n], g[n]) for n in g}
        buffers.append({n: b.clone() for n, b in m.named_buffers()})
    n = len(batches)
    mean = {k: None if v is None else v / n for k, v in grads.items()}
    return torch.stack(losses).mean(), mean, buffers


def _add(a, b):
    return None if a is None else a + b


def shard_of(full: torch.Tensor, dtensor) -> torch.Tensor:
    """This rank's chunk of ``full``, placed like ``dtensor`` (an independent slicing)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full.detach(), dtensor.device_mesh, dtensor.placements, src_data_rank=None
    ).to_local()


class WideBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Wide(nn.Module):
    """Blocks whose parameters dwarf the activations of a batch of one: memory is parameters."""

    def __init__(self, d: int = 256, layers: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.Sequential(*(WideBlock(d) for _ in range(layers)))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (torchvision's wheels for our torch are CUDA builds that
    fail to import on CPU machines)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (7x7 stem, max pool, 4 stages of 2 BasicBlocks, pooled linear head),
    narrow; ``reinit``: re-initialise in ``__init__`` as torchvision's ResNet does."""

    def __init__(self, width: int = 8, classes: int = 10, reinit: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages, cin = [], width
        for i, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)
        if reinit:
            for m in self.modules():
                resnet_init(m)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(x).mean((2, 3)))


def resnet_init(m: nn.Module) -> None:
    """torchvision's ResNet init: Kaiming-normal convolutions, BatchNorm 1 and 0."""
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.constant_(m.weight, 1)
        nn.init.constant_(m.bias, 0)


def meta_mlp(inp: int, hidden: int, out: int, act: type[nn.Module] = nn.ReLU):
    """``Linear(inp, hidden) -> act -> Linear(hidden, out)`` (seed 0), its parameters extracted
    and the module moved to meta: ``(module, params)``."""
    import funcshard as fs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(inp, hidden), act(), nn.Linear(hidden, out))
    params, _ = fs.extract(model)
    model.to("meta")
    return model, params
