"""A small mixture of experts with true expert parallelism, as torchtitan's MoE: a router picks
each token's top-2 of E experts, the tokens are sorted by expert, and the experts (stacked
``[E, ...]`` weights) run on the tokens routed to them. Under :class:`ExpertParallel` each rank
of the ep mesh holds E / ep whole experts and receives their tokens from the other ep ranks by
all-to-all (and sends the outputs back the same way); unparallelized, one rank runs all E."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from _tp import IN, OUT, D

E, H = 4, 6  # experts, their hidden size
TOP = 2


class Experts(nn.Module):
    """E experts ``relu(x @ w1[e]) @ w2[e]``, run on tokens already sorted by expert."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, H) * D**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * H**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: ``[tokens, D]`` sorted by (local) expert, ``counts[e]`` of them for expert
        ``e`` of this rank's ``w1.shape[0]`` experts."""
        # torchtitan's GroupedExperts: token counts are data dependent, DTensor cannot say so
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        parts = x.split(counts.tolist())
        return torch.cat([torch.relu(p @ w1[e]) @ w2[e] for e, p in enumerate(parts)])


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        top, idx = self.router(h).topk(TOP, dim=-1)
        gates = top.softmax(-1)
        order = idx.flatten().argsort(stable=True)  # (token, k) pairs sorted by expert
        counts = torch.bincount(idx.flatten(), minlength=E)
        out = self.experts(h.repeat_interleave(TOP, 0)[order], counts)
        routed = torch.empty_like(out).index_copy(0, order, out).view(-1, TOP, D)
        return self.head(h + (gates.unsqueeze(-1) * routed).sum(1))


def make_moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE()


class ExpertParallel(ParallelStyle):
    """torchtitan's expert parallelism for :class:`Experts` on a 1-D ep mesh: ``Shard(0)`` of
    the stacked weights (whole experts per rank), tokens dispatched to their experts' ranks by
    all-to-all before the experts run and combined back after."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        state: dict = {}

        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

        def dispatch(mod, inputs, mesh):
            x, counts = inputs
            ep, group = mesh.size(), mesh.get_group()
            with torch.no_grad():
                received = torch.ops._c10d_functional.wait_tensor(
                    all_to_all_single(counts, None, None, group=group)
                )
                send = counts.view(ep, -1).sum(1).tolist()
                recv = received.view(ep, -1).sum(1).tolist()
            x = all_to_all_single_autograd(x, recv, send, group)
            # received: [from rank r: tokens of local expert 0, 1, ...] -> grouped by expert
            local = received.view(ep, -1)
            source = torch.arange(x.shape[0]).split(local.flatten().tolist())
            order = torch.cat([source[r * local.shape[1] + e]
                               for e in range(local.shape[1]) for r in range(ep)])  # fmt: skip
            state.update(send=send, recv=recv, order=order)
            return x[order], local.sum(0)

        def combine(mod, out, mesh):
            back = torch.empty_like(out).index_copy(0, state["order"], out)
            return all_to_all_single_autograd(back, state["send"], state["recv"], mesh.get_group())

        return distribute_module(module, mesh, partition, dispatch, combine)
