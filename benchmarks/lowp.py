"""Low-precision weights, funcshard against FSDP2: bytes gathered per step and step time.

Run: ``python -m benchmarks.lowp`` (2 gloo ranks on this machine; ``--quick``: small and
short). Two of torchao's training recipes on a stack of MLP blocks (``width`` -> 4 x ``width`` ->
``width``, one group per block):

* QLoRA: every linear's weight NF4 (frozen, torchao's ``to_nf4`` with torchtune's blocks: 64
  values, scales in blocks of 256), LoRA adapters of rank 8 trained; a LayerNorm per block;
* float8 training: ``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True``
  (the weights gathered in float8) and with ``False`` (gathered in float32, cast after).

FSDP2 (``fully_shard`` per block and on the root) and funcshard (``fs.schedule`` with a group
per block, ``fs.value_and_grad``) train the same model on the same batches, each step
forward, backward and AdamW on the trained parameters (``torch.optim.AdamW`` on FSDP2's
DTensors, ``fs.optim.adamw`` on funcshard's shards), interleaved step by step. Per rank: the
median step time, the bytes all-gathered and reduce-scattered per step (the collectives' own
buffers, counted from the dispatched c10d operators, received bytes for the all-gathers), and
the largest difference between the two frameworks' trained parameters at the end (both
compute the same thing: 0 means bit for bit).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import funcshard as fs

_KINDS = {"all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
          "all_reduce": "all_reduce", "allreduce_": "all_reduce"}  # fmt: skip


class _Bytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes per kind of collective: an all-gather's output (what each rank receives), a
    reduce-scatter's or all-reduce's input."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.bytes = world, dict.fromkeys(("all_gather", "reduce_scatter"), 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _KINDS.get(func.overloadpacket.__name__)
        if kind in self.bytes and func.namespace in ("_c10d_functional", "c10d"):
            t = args[1] if func.namespace == "c10d" else args[0]
            t = t[0] if isinstance(t, list) else t
            n = t.numel() * t.element_size()
            self.bytes[kind] += n * (self.world if kind == "all_gather" else 1)
        return func(*args, **(kwargs or {}))


class LoRALinear(nn.Module):
    """QLoRA's linear: a frozen NF4 weight and a trained update ``B(A(x))``."""

    def __init__(self, d_in: int, d_out: int, rank: int = 8) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        w = nn.Linear(d_in, d_out, bias=False).weight.detach()
        self.weight = nn.Parameter(to_nf4(w), requires_grad=False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self, width: int, linear) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = linear(width, 4 * width), linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def model(kind: str, width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "qlora":
        return nn.Sequential(*(Block(width, LoRALinear) for _ in range(blocks)))
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = nn.Sequential(*(Block(width, nn.Linear) for _ in range(blocks)))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=kind == "float8")
    return convert_to_float8_training(m, config=config)


def measure(kind: str, width: int = 256, blocks: int = 4, tokens: int = 256, steps: int = 20):
    warnings.filterwarnings("ignore", category=UserWarning)
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    theirs = model(kind, width, blocks)
    for block in theirs:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    their_opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-3)

    ours = model(kind, width, blocks)
    sharded = fs.shard(fs.extract(ours)[0], mesh)
    frozen = {k: v for k, v in sharded.items() if not v.requires_grad}
    params = {k: v for k, v in sharded.items() if v.requires_grad}
    apply = fs.schedule(ours, fs.plan(ours, fs.policy.by_type(Block)))
    vg = fs.value_and_grad(lambda p, x: apply({**frozen, **p}, x).square().mean())
    opt = fs.optim.adamw(1e-3)
    state = opt.init(params)

    gen = torch.Generator().manual_seed(rank)
    times = {"FSDP2": [], "funcshard": []}
    sent = {}
    for step in range(steps + 3):
        x = torch.randn(tokens, width, generator=gen)
        for name in times:
            dist.barrier()
            start = time.perf_counter()
            with _Bytes(world) as counted:
                if name == "FSDP2":
                    theirs(x).square().mean().backward()
                    their_opt.step()
                    their_opt.zero_grad()
                else:
                    _, grads = vg(params, x)
                    params, state = fs.optim.step(opt, params, grads, state)
            if step >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
            sent[name] = counted.bytes
    their_params = dict(theirs.named_parameters())
    diff = max(
        (params[k].to_local() - their_params[k].to_local()).abs().max().item() for k in params
    )
    out = {"max |funcshard - FSDP2| of the trained parameters": diff}
    for name in times:
        out[f"{name} ms"] = statistics.median(times[name]) * 1e3
        out[f"{name} all-gathered KiB"] = sent[name]["all_gather"] / 2**10
        out[f"{name} reduce-scattered KiB"] = sent[name]["reduce_scatter"] / 2**10
    out["time funcshard / FSDP2"] = out["funcshard ms"] / out["FSDP2 ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size = dict(width=128, blocks=2, tokens=32, steps=3) if args.quick else {}
    for kind in ("qlora", "float8", "float8 (float32 all-gather)"):
        results = fs.testing.run(measure, kind, **size, world=2, timeout=1800)
        print(f"{kind}:")
        for rank, result in enumerate(results):
            print(f"  rank {rank}: " + ", ".join(f"{k}: {v:.4g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
