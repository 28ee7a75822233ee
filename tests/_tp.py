"""A small model for FSDP x tensor parallel tests, its TP plan, and data."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _mesh import mesh

D, H, IN, OUT = 8, 12, 6, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make(seed: int = 0, blocks: int = 2) -> Net:
    torch.manual_seed(seed)
    return Net(blocks)


def tp_plan(model: Net) -> dict:
    """Colwise w1 / rowwise w2 in every block (the Megatron MLP); the rest is not parallel."""
    return {
        f"blocks.{i}.{name}": style()
        for i in range(len(model.blocks))
        for name, style in (("w1", ColwiseParallel), ("w2", RowwiseParallel))
    }


def parallelized(seed: int = 0, blocks: int = 2, names=("dp", "tp"), shape=(2, 2)):
    """``(mesh, model)``: the model parallelized on ``mesh[names[-1]]``."""
    m = mesh(*shape, names=names)
    model = make(seed, blocks)
    parallelize_module(model, m[names[-1]], tp_plan(model))
    return m, model


def batch(step: int, dp_rank: int | None = None, dp: int = 2, per_rank: int = 3):
    """``(x, y)``: the global batch, or the slice of data-parallel rank ``dp_rank``."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(dp * per_rank, IN, generator=g)
    y = torch.randn(dp * per_rank, OUT, generator=g)
    if dp_rank is None:
        return x, y
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return x[rows], y[rows]


def dp_rank(m, name: str = "dp") -> int:
    return m[name].get_local_rank() if name in (m.mesh_dim_names or ()) else dist.get_rank()


def loss(out, y):
    return ((out - y) ** 2).mean()


class Counter:
    """Counts collectives by (kind, mesh dim name), for functional (funcshard, DTensor) and
    in-place (FSDP2) c10d ops: ``with Counter(mesh, ...) as c: ...; c.counts``."""

    def __init__(self, *meshes) -> None:
        self.names = {m[n].get_group().group_name: n for m in meshes for n in m.mesh_dim_names}
        self.counts: dict[tuple[str, str], int] = {}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from _comm import KINDS

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kind = KINDS.get(func.overloadpacket.__name__)
                if kind is not None and func.namespace in ("_c10d_functional", "c10d"):
                    name = next((counter._group(a) for a in args if counter._group(a)), "?")
                    key = (kind, name)
                    counter.counts[key] = counter.counts.get(key, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def _group(self, a):
        if isinstance(a, torch.ScriptObject):  # in-place c10d ops take the boxed group
            a = dist.ProcessGroup.unbox(a)
        name = a if isinstance(a, str) else getattr(a, "group_name", None)
        return self.names.get(name) if isinstance(name, str) else None


E = 4  # experts


class MoE(nn.Module):
    """A router and E experts (stacked ``[E, ...]`` weights), top-2: each token's output is the
    gate-weighted sum of its two experts (computed densely: a tiny model)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, D, H) * D**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * H**-0.5)
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        h = self.inp(x)
        logits = self.router(h)
        top, idx = logits.topk(2, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, idx, top.softmax(-1))
        y = torch.einsum("td,edh->teh", h, self.w1).relu()
        y = torch.einsum("teh,ehd->ted", y, self.w2)
        return self.head(h + (gates.unsqueeze(-1) * y).sum(1))


def make_moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE()


class SPMDNet(nn.Module):
    """The Megatron MLP written as DTensor ops on a whole ``(dp, tp)`` mesh (full SPMD): the
    input is a DTensor sharded over dp on the batch, the loss a global-batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(IN, H)
        self.w2 = nn.Linear(H, OUT)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def spmd_net(m, seed: int = 0) -> SPMDNet:
    """The net with DTensor parameters of the whole mesh: colwise w1, rowwise w2, Replicate()
    over dp (the layout FSDP2's ``dp_mesh_dims`` takes)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(seed)
    net = SPMDNet()
    tp = {"w1.weight": Shard(0), "w1.bias": Shard(0), "w2.weight": Shard(1), "w2.bias": Replicate()}
    for name, p in list(net.named_parameters()):
        owner, attr = name.split(".")
        d = distribute_tensor(p.detach(), m, [Replicate(), tp[name]])
        setattr(getattr(net, owner), attr, nn.Parameter(d))
    return net
