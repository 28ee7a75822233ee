"""FSDP x TP: funcshard's 2-D layout against FSDP2 + TP on the same Llama-style model.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 -m benchmarks.parallel2d

Both sides: ``examples/train_2d.py``'s model, each block parallelized on ``mesh["tp"]`` with
torchtitan's plan; funcshard shards with ``fs.shard(params, mesh["dp"])`` and runs ``fs.schedule``
(a group per block) + ``fs.optim.step(adamw)``; FSDP2 runs ``fully_shard`` per block and on the
root + ``torch.optim.AdamW``. Measured: the step time (alternating rounds, the slowest rank's,
see harness [Note: fair timing]), the peak of live CPU allocations during one step (profiler
allocation events, every thread), and the bytes each rank sends per mesh dim in one
forward + backward against the lower bound for dp (see ``comms`` [Note: the lower bound]: over
dp, the TP-local parameters are gathered twice and reduce-scattered once; the root group is
gathered once, so slightly under the bound is expected). Over tp, the bytes are TP's
activation all-reduces: the model's, the same for any data-parallel layer. Rank 0 writes
``benchmarks/results/parallel2d-<W>ranks.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs

from . import harness
from .comms import buffer_bytes, kind_of, sent_bytes
from .memory import _events

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_2d


class PerDim(TorchDispatchMode):
    """Collectives and bytes sent per mesh dim name."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.names = {mesh[n].get_group().group_name: n for n in mesh.mesh_dim_names}
        self.sizes = {n: mesh[n].size() for n in mesh.mesh_dim_names}
        self.count: dict[str, int] = {}
        self.sent: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        kind = kind_of(func.overloadpacket.__name__)
        if kind is not None and func.namespace in ("c10d", "_c10d_functional"):
            dim = next((d for d in map(self._dim, args) if d), "?")
            key = f"{kind} {dim}"
            self.count[key] = self.count.get(key, 0) + 1
            nbytes = buffer_bytes(args, result)
            self.sent[dim] = self.sent.get(dim, 0.0) + sent_bytes(kind, nbytes, self.sizes[dim])
        return result

    def _dim(self, a):
        if isinstance(a, torch.ScriptObject):
            a = dist.ProcessGroup.unbox(a)
        name = a if isinstance(a, str) else getattr(a, "group_name", None)
        return self.names.get(name) if isinstance(name, str) else None


def build(args, mesh):
    torch.manual_seed(0)
    model = train_2d.Llama(args.vocab, args.width, args.depth, args.heads)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], train_2d.TP_PLAN)
    return model


def funcshard_step(args, mesh):
    model = build(args, mesh)
    sharded = fs.shard(fs.extract(model)[0], mesh["dp"])
    apply = fs.schedule(model, fs.plan(model, fs.policy.by_type(train_2d.Block)))
    opt = fs.optim.adamw(1e-3)
    state = {"p": sharded, "s": opt.init(sharded)}

    def loss_fn(p, tokens):
        return F.cross_entropy(apply(p, tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    def forward_backward(tokens):
        return fs.value_and_grad(loss_fn)(state["p"], tokens)

    def step(tokens):
        _, grads = forward_backward(tokens)
        state["p"], state["s"] = fs.optim.step(opt, state["p"], grads, state["s"])

    return step, forward_backward, lambda: state["p"].values()


def fsdp2_step(args, mesh):
    model = build(args, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward_backward(tokens):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    def step(tokens):
        forward_backward(tokens)
        opt.step()
        opt.zero_grad()

    return step, forward_backward, model.parameters


def peak_mib(step, tokens) -> float:
    """The peak of live CPU allocations during ``step(tokens)`` (every thread), MiB."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(tokens)
    events, _ = _events(prof, "cpu")
    live = peak = 0
    for e in sorted(events, key=lambda e: e.time):
        live += e.size
        peak = max(peak, live)
    return peak / 2**20


def dp_bound_mib(params, dp: int) -> float:
    """[Note: the lower bound] over dp for the TP-local parameters (fp32, resharded)."""
    local = sum(
        (p._local_tensor.numel() * dp if isinstance(p, DTensor) else p.numel()) * 4 for p in params
    )
    return (dp - 1) / dp * 3 * local / 2**20


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=harness.RESULTS)
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    per = args.batch // dp
    rows = mesh["dp"].get_local_rank()

    def tokens(i):
        t = train_2d.batch(i, args.batch, args.context, args.vocab)
        return t[rows * per : (rows + 1) * per]

    trainers = {"fsdp2": fsdp2_step(args, mesh), "funcshard": funcshard_step(args, mesh)}
    times = harness.alternate(
        {n: (lambda i, s=t[0]: s(tokens(i))) for n, t in trainers.items()},
        rounds=args.rounds,
        warmup=2,
        device=torch.device("cpu"),
    )
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"dp": dp}
    out: dict[str, Any] = {"config": config, "machine": harness.machine(torch.device("cpu"))}
    for name, (step, forward_backward, params) in trainers.items():
        gc.collect()
        dist.barrier()
        peak = peak_mib(step, tokens(100))
        with PerDim(mesh) as comm:
            forward_backward(tokens(101))
        everyone = [None] * world
        dist.all_gather_object(everyone, peak)
        out[name] = {
            "step_ms": statistics.median(times[name]) * 1e3,
            "peak_mib_max_rank": max(everyone),
            "collectives": comm.count,
            "sent_mib": {d: b / 2**20 for d, b in comm.sent.items()},
            "dp_bound_mib": dp_bound_mib(list(params()), dp),
        }
    if rank == 0:
        harness.write(f"parallel2d-{world}ranks", out, args.out)
        base = out["fsdp2"]
        print("| | step ms | x FSDP2 | peak MiB | x FSDP2 | dp MiB | x dp bound | tp MiB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in trainers:
            r = out[name]
            step, peak, sent = r["step_ms"], r["peak_mib_max_rank"], r["sent_mib"]
            print(
                f"| {name} | {step:.1f} | {step / base['step_ms']:.2f} | {peak:.1f} | "
                f"{peak / base['peak_mib_max_rank']:.2f} | {sent['dp']:.2f} | "
                f"{sent['dp'] / r['dp_bound_mib']:.3f} | {sent.get('tp', 0):.2f} |"
            )
        print(out["funcshard"]["collectives"], out["fsdp2"]["collectives"])
    return out


if __name__ == "__main__":
    main()
