"""Part ``host``: the host's cost per block of a training step, where compute is negligible.

A Llama-style decoder (RMSNorm, attention through SDPA with rotary embeddings, SwiGLU, untied
head) with tiny blocks (width 32, a batch of 1x8 tokens) on ONE gloo rank: every block's step is
Python and dispatch, as on a GPU that waits for the host. Each framework trains at two depths;
the slope between them is the cost of one block (forward + backward, and an AdamW step), the
intercept the rest. Plain torch (no sharding) is the floor; FSDP2 (``fully_shard`` per block and
the root) the peer; funcshard ``fs.schedule`` + ``fs.value_and_grad`` + ``fs.optim.step`` with
one group per block. Wall time per step and the step thread's CPU time, medians over rounds;
per block, the ATen calls and, of those, the ones that would each launch a kernel on a GPU
(``harness.launches_on_cpu``: not views, aliases or bare allocations).

    OMP_NUM_THREADS=1 python -m benchmarks.host           # prints a table, writes host.json
    OMP_NUM_THREADS=1 python -m benchmarks.host --world 8 # 8 ranks over a fake process group
    OMP_NUM_THREADS=1 python -m benchmarks.host --ops 30  # and the top 30 ATen ops per block

With ``--world N`` (N > 1) the step runs in one process over torch's fake process group
(``fake.py``: collectives return at once, moving nothing): the host's cost per block of the
multi-rank path (copy-in, collectives issued, copy-out, reduce-scatter), which one real rank
does not have (a mesh of one rank gathers nothing).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

from . import harness


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:  # what fs.materialize calls to write the ones
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rotary(x, cos, sin):
    a, b = x.chunk(2, -1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


def _repeat_heads(x, times: int):
    """``(b, kv_heads, t, hd) -> (b, kv_heads * times, t, hd)``, each key-value head repeated
    for the query heads that share it (grouped-query attention, as torchtitan's ``repeat_kv``)."""
    if times == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, times, t, hd).reshape(b, kv * times, t, hd)


class LlamaBlock(nn.Module):
    def __init__(
        self, d: int, heads: int, hidden: int | None = None, kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        kv_width = d // heads * self.kv_heads
        self.attn_norm = RMSNorm(d)
        self.wq, self.wk = nn.Linear(d, d, bias=False), nn.Linear(d, kv_width, bias=False)
        self.wv, self.wo = nn.Linear(d, kv_width, bias=False), nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        hidden = hidden or 3 * d  # the SwiGLU width
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (w(h).view(b, t, self.kv_heads, -1).transpose(1, 2) for w in (self.wk, self.wv))
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        k, v = (_repeat_heads(y, self.heads // self.kv_heads) for y in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(
        self, layers: int, d: int = 32, heads: int = 2, vocab: int = 64, seq: int = 8,
        hidden: int | None = None, kv_heads: int | None = None,
    ):  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, hidden, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        half = d // heads // 2
        self.register_buffer("cos", torch.empty(seq, half), persistent=False)
        self.register_buffer("sin", torch.empty(seq, half), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The rotary tables, in the buffers' dtype (what fs.materialize calls to write them)."""
        seq, half = self.cos.shape
        steps = torch.arange(half, device=self.cos.device).float() / half
        at = torch.arange(seq, device=self.cos.device).float()
        freqs = torch.outer(at, 1e4**-steps)
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, self.cos[:t], self.sin[:t])
        return self.head(self.norm(h))


def _loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _build(layers: int) -> Llama:
    torch.manual_seed(0)
    return Llama(layers)


def _torch_step(model: nn.Module):
    """A step of ``model``'s own parameters: forward, backward, ``torch.optim.AdamW``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(tokens):
        _loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def plain(layers: int, mesh):
    return _torch_step(_build(layers))


def fsdp2(layers: int, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _build(layers)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _torch_step(model)


def funcshard(layers: int, mesh):
    model = _build(layers)
    params, buffers = fs.extract(model)
    box = {"params": fs.shard(params, mesh)}
    plan = fs.plan(model, fs.policy.by_type(LlamaBlock))
    model.to("meta")
    apply = fs.schedule(model, plan)
    opt = fs.optim.adamw(1e-3)
    box["state"] = opt.init(box["params"])
    value_and_grad = fs.value_and_grad(lambda p, t: _loss(apply(p, t, buffers=buffers), t))

    def step(tokens):
        _, grads = value_and_grad(box["params"], tokens)
        box["params"], box["state"] = fs.optim.step(opt, box["params"], grads, box["state"])

    return step


FRAMEWORKS = {"plain torch": plain, "FSDP2": fsdp2, "funcshard": funcshard}


def aten_events(step, tokens) -> list:
    """The profiler's ``aten::`` events of one call of ``step(tokens)``, nested ones included:
    what the host does per step, independent of its speed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(tokens)
    return [e for e in prof.events() if e.name.startswith("aten::")]


def aten_ops(step, tokens) -> collections.Counter:
    """The ATen operations one call of ``step(tokens)`` dispatches, by name."""
    return collections.Counter(e.name for e in aten_events(step, tokens))


def aten_calls(step, tokens) -> int:
    """How many ATen operations one call of ``step(tokens)`` dispatches (:func:`aten_ops`)."""
    return aten_ops(step, tokens).total()


def measure(mesh, depths=(4, 16), rounds: int = 30, warmup: int = 5) -> dict[str, Any]:
    """Median wall and thread-CPU ms per step for each framework and depth, alternating."""
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    steps = {(name, d): make(d, mesh) for name, make in FRAMEWORKS.items() for d in depths}
    wall: dict[Any, list[float]] = {k: [] for k in steps}
    cpu: dict[Any, list[float]] = {k: [] for k in steps}
    keys = list(steps)
    for i in range(warmup + rounds):
        k = i % len(keys)
        for key in keys[k:] + keys[:k]:
            t0, c0 = time.perf_counter(), time.thread_time()
            steps[key](tokens)
            t1, c1 = time.perf_counter(), time.thread_time()
            if i >= warmup:
                wall[key].append(t1 - t0)
                cpu[key].append(c1 - c0)
    lo, hi = min(depths), max(depths)
    rows = {}
    for name in FRAMEWORKS:
        med = {d: 1e3 * statistics.median(wall[(name, d)]) for d in depths}
        cmed = {d: 1e3 * statistics.median(cpu[(name, d)]) for d in depths}
        rows[name] = {
            "ms_per_step": med,
            "cpu_ms_per_step": cmed,
            "ms_per_block": (med[hi] - med[lo]) / (hi - lo),
            "cpu_ms_per_block": (cmed[hi] - cmed[lo]) / (hi - lo),
        }
    for name in FRAMEWORKS:  # the deterministic part: operations the host dispatches
        events = {d: aten_events(steps[(name, d)], tokens) for d in depths}
        ops = {d: collections.Counter(e.name for e in events[d]) for d in depths}  # aten_ops
        calls = {d: ops[d].total() for d in depths}  # aten_calls
        rows[name]["aten_calls_per_step"] = calls
        rows[name]["aten_calls_per_block"] = (calls[hi] - calls[lo]) / (hi - lo)
        kernels = {d: harness.launches_on_cpu(events[d]) for d in depths}
        rows[name]["launches_per_step"] = kernels
        rows[name]["launches_per_block"] = (kernels[hi] - kernels[lo]) / (hi - lo)
        per_block = {op: (ops[hi][op] - ops[lo][op]) / (hi - lo) for op in ops[hi] | ops[lo]}
        rows[name]["aten_ops_per_block"] = {
            op: n for op, n in sorted(per_block.items(), key=lambda kv: -kv[1]) if n
        }
    for row in rows.values():
        row["per_block_vs_fsdp2"] = row["ms_per_block"] / rows["FSDP2"]["ms_per_block"]
        row["per_block_vs_plain"] = row["ms_per_block"] / rows["plain torch"]["ms_per_block"]
    return {"depths": list(depths), "rounds": rounds, "rows": rows}


def _print_ops(rows: dict[str, Any], top: int) -> None:
    """The ``top`` ATen ops per block (over all frameworks' counts), one column per framework."""
    names = list(rows)
    ops = collections.Counter()
    for row in rows.values():
        ops.update({op: abs(n) for op, n in row["aten_ops_per_block"].items()})
    print(f"\n{'aten ops per block':36}" + "".join(f"{n:>14}" for n in names))
    for op, _ in ops.most_common(top):
        counts = (rows[n]["aten_ops_per_block"].get(op, 0) for n in names)
        print(f"{op:36}" + "".join(f"{c:14.4g}" for c in counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world", type=int, default=1, help="> 1: a fake process group")
    parser.add_argument("--ops", type=int, default=0, help="print the top N ATen ops per block")
    args = parser.parse_args()
    rounds = dict(rounds=3 if args.quick else args.rounds, warmup=1 if args.quick else 5)
    if args.world > 1:
        from .fake import fake_world

        with fake_world(args.world) as mesh:
            result = measure(mesh, **rounds)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            result = measure(init_device_mesh("cpu", (1,)), **rounds)
        finally:
            dist.destroy_process_group()
    result["world"] = args.world
    result["machine"] = harness.machine(torch.device("cpu"))
    print(f"{'':14}{'ms/block':>10}{'cpu ms/block':>14}{'x FSDP2':>9}{'x plain':>9}"
          f"{'aten calls/block':>18}{'launches/block':>16}")  # fmt: skip
    for name, row in result["rows"].items():
        print(f"{name:14}{row['ms_per_block']:10.3f}{row['cpu_ms_per_block']:14.3f}"
              f"{row['per_block_vs_fsdp2']:9.2f}{row['per_block_vs_plain']:9.2f}"
              f"{row['aten_calls_per_block']:18.0f}{row['launches_per_block']:16.0f}")  # fmt: skip
    if args.ops:
        _print_ops(result["rows"], args.ops)
    if not args.quick:
        harness.write("host" if args.world == 1 else f"host-fake{args.world}", result)


if __name__ == "__main__":
    main()
