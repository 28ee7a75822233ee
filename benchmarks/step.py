"""funcshard vs FSDP2 on the same model, side by side in one run: step time, peak memory and
collectives of a training step (forward + backward), reported as ratios to FSDP2.

    torchrun --standalone --nproc-per-node 2 benchmarks/step.py [--layers 8 --width 256]

FSDP2 is ``fully_shard`` on every block and on the root (reshard after forward, default
prefetch). funcshard runs the same grouping with ``fs.schedule`` (prefetch 1), and, for
reference, ``fs.unshard`` of the whole tree. Steps are interleaved (one of each in turn) so
that machine noise hits all variants alike; times are medians. Peak memory comes from the
allocator's events during one profiled step, twice: the framework's own allocations (the
calling thread), and all threads -- which adds gloo's full-size temporary for each all-gather
in flight (gloo gathers into a scratch buffer on its worker thread, then copies out; NCCL does
not), and so grows with how long gathers overlap compute. Nothing here is asserted: the
numbers are for people.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

import funcshard as fs
from funcshard._profiling import peak_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from _data import batch  # synthetic tokens
from train_lm import LM, Block  # the main job's model


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def variants(args, mesh):
    vocab, length = args.vocab, args.seq
    dtype = torch.bfloat16 if args.bf16 else None

    def build():
        torch.manual_seed(0)
        return LM(vocab, args.width, 4, args.layers, length)

    ref = build()
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(ref, mesh=mesh, mp_policy=mp)

    def fsdp2(tokens):
        loss = lm_loss(ref(tokens).float(), tokens)
        loss.backward()
        for p in ref.parameters():
            p.grad = None
        return loss

    model = build()
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh)
    plan = fs.plan(model, fs.policy.by_type(Block), prefetch=1, backward_prefetch=1)
    model.to("meta")
    apply = fs.schedule(model, plan, param_dtype=dtype, reduce_dtype=torch.float32)

    def scheduled(tokens):
        return fs.value_and_grad(lambda p: lm_loss(apply(p, tokens).float(), tokens))(sharded)[0]

    def whole(tokens):
        def loss_fn(p):
            full = fs.unshard(p, param_dtype=dtype, reduce_dtype=torch.float32)
            return lm_loss(fs.functional_call(model, (full, buffers), (tokens,)).float(), tokens)

        return fs.value_and_grad(loss_fn)(sharded)[0]

    return {"fsdp2": fsdp2, "funcshard.schedule": scheduled, "funcshard.unshard": whole}


def collectives(step, tokens) -> dict[str, int]:
    with CommDebugMode() as comm:
        step(tokens)
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items() if v}


def main() -> None:
    warnings.filterwarnings("ignore", message=".*(returned a view tensor|Full backward hook).*")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--json", help="also write the results here (rank 0)")
    args = ap.parse_args()

    mesh = init_device_mesh("cpu", (int(os.environ.get("WORLD_SIZE", "2")),))
    rank = dist.get_rank()
    steps = variants(args, mesh)
    data = [batch(i, rank, args.batch, args.seq, args.vocab) for i in range(args.steps)]
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(data[i % args.steps])
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    results = {}
    for name, step in steps.items():
        dist.barrier()
        own, _ = peak_bytes(lambda step=step: step(data[0]), this_thread=True)
        dist.barrier()
        peak, _ = peak_bytes(lambda step=step: step(data[0]))
        results[name] = {
            "step_ms": statistics.median(times[name]) * 1e3,
            "peak_mib": own / 2**20,
            "peak_all_threads_mib": peak / 2**20,
            "collectives": collectives(step, data[0]),
        }
    if rank == 0:
        base = results["fsdp2"]
        print(
            f"{args.layers} layers x {args.width} wide, batch {args.batch}x{args.seq}, "
            f"{mesh.size()} ranks, {'bf16' if args.bf16 else 'fp32'}; medians of {args.steps}"
        )
        print(
            f"{'':20s} {'step ms':>8s} {'x fsdp2':>8s} {'peak MiB':>9s} {'x fsdp2':>8s} "
            f"{'all thr.':>9s} {'x fsdp2':>8s}  collectives"
        )
        for name, r in results.items():
            ratio = {k: r[k] / base[k] for k in ("step_ms", "peak_mib", "peak_all_threads_mib")}
            print(
                f"{name:20s} {r['step_ms']:8.1f} {ratio['step_ms']:8.2f} "
                f"{r['peak_mib']:9.1f} {ratio['peak_mib']:8.2f} "
                f"{r['peak_all_threads_mib']:9.1f} {ratio['peak_all_threads_mib']:8.2f}  "
                f"{r['collectives']}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
