"""funcshard compiled vs eager, and FSDP2 eager vs FSDP2 + torch.compile, on the same model and
data, side by side in one run: step time, peak memory, compile time and recompilations of a
training step (forward + backward), reported as ratios to FSDP2 eager.

    torchrun --standalone --nproc-per-node 2 benchmarks/compile.py [--layers 4 --width 256]

funcshard's compiled variants are ``torch.compile(fs.value_and_grad(loss), fullgraph=True)``
with the default (inductor) backend, over ``fs.schedule`` (one block gathered at a time,
prefetch 1, reshard after forward) and over ``fs.unshard`` of the whole tree. FSDP2 + compile
is ``torch.compile`` of the ``fully_shard`` model (its hooks run eagerly between graphs, as
FSDP2 does under Dynamo). Compile time is the first call's; recompilations are counted after
it. Steps are interleaved so that machine noise hits all variants alike; times are medians.
Peak memory comes from the allocator's events during a step (the median of three; see
``benchmarks/step.py``).
Nothing is asserted: the numbers are for people.
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
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import funcshard as fs
from funcshard._profiling import peak_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from _data import batch  # synthetic tokens
from train_lm import LM, Block  # the main job's model


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def build(args) -> LM:
    torch.manual_seed(0)
    return LM(args.vocab, args.width, 4, args.layers, args.seq)


def fsdp2_variants(args, mesh) -> dict:
    model = build(args)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)

    def step(net):
        def run(tokens):
            loss = lm_loss(net(tokens), tokens)
            loss.backward()
            for p in model.parameters():
                p.grad = None
            return loss

        return run

    return {"fsdp2": (step(model), None), "fsdp2 + compile": (step(compiled), counter)}


def funcshard_variants(args, mesh) -> dict:
    model = build(args)
    params, buffers = fs.extract(model)
    sharded = fs.shard(params, mesh)
    plan = fs.plan(model, fs.policy.by_type(Block), prefetch=1, backward_prefetch=1)
    model.to("meta")
    apply = fs.schedule(model, plan)

    def scheduled(p, tokens):
        return lm_loss(apply(p, tokens, buffers=buffers), tokens)

    def whole(p, tokens):
        return lm_loss(fs.functional_call(model, (fs.unshard(p), buffers), (tokens,)), tokens)

    out = {}
    for name, loss_fn in (("funcshard.schedule", scheduled), ("funcshard.unshard", whole)):
        vg = fs.value_and_grad(loss_fn)
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(vg, backend=counter, fullgraph=True)
        out[name] = (lambda tokens, vg=vg: vg(sharded, tokens)[0], None)
        out[f"{name} + compile"] = (lambda tokens, c=compiled: c(sharded, tokens)[0], counter)
    return out


def main() -> None:
    warnings.filterwarnings("ignore", message=".*(returned a view tensor|Full backward hook).*")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-fsdp2-compile", action="store_true", help="skip FSDP2 + compile")
    ap.add_argument("--json", help="also write the results here (rank 0)")
    args = ap.parse_args()

    mesh = init_device_mesh("cpu", (int(os.environ.get("WORLD_SIZE", "2")),))
    rank = dist.get_rank()
    steps = {**fsdp2_variants(args, mesh), **funcshard_variants(args, mesh)}
    if args.no_fsdp2_compile:
        del steps["fsdp2 + compile"]
    data = [batch(i, rank, args.batch, args.seq, args.vocab) for i in range(args.steps)]
    results: dict[str, dict] = {name: {} for name in steps}
    for name, (step, counter) in steps.items():  # first calls: compilation
        dist.barrier()
        t0 = time.perf_counter()
        try:
            step(data[0])
        except Exception as e:  # report, and leave the variant out
            results[name]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        results[name]["compile_s"] = time.perf_counter() - t0 if counter else None
        results[name]["frames"] = counter.frame_count if counter else None
    ok = {n: s for n, s in steps.items() if "error" not in results[n]}
    times: dict[str, list[float]] = {name: [] for name in ok}
    for i in range(args.warmup + args.steps):
        for name, (step, _) in ok.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(data[i % args.steps])
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    for name, (step, counter) in ok.items():
        own, peak = [], []
        for _ in range(3):  # the peak moves with when gloo's threads free: take the median
            dist.barrier()
            own.append(peak_bytes(lambda step=step: step(data[0]), this_thread=True)[0])
            dist.barrier()
            peak.append(peak_bytes(lambda step=step: step(data[0]))[0])
        results[name].update(
            step_ms=statistics.median(times[name]) * 1e3,
            peak_mib=statistics.median(own) / 2**20,
            peak_all_threads_mib=statistics.median(peak) / 2**20,
            recompiles=counter.frame_count - results[name]["frames"] if counter else None,
        )
    if rank == 0:
        report(args, mesh, results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
    dist.destroy_process_group()


def report(args, mesh, results: dict) -> None:
    base = results["fsdp2"]
    print(
        f"{args.layers} layers x {args.width} wide, batch {args.batch}x{args.seq}, "
        f"{mesh.size()} ranks, fp32, inductor; medians of {args.steps} forward+backward steps"
    )
    cols = ("step_ms", "peak_mib", "peak_all_threads_mib")
    print(
        f"{'':28s} {'step ms':>8s} {'x fsdp2':>8s} {'peak MiB':>9s} {'x fsdp2':>8s} "
        f"{'all thr.':>9s} {'x fsdp2':>8s} {'compile s':>10s} {'graphs':>7s} {'recompiles':>10s}"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:28s} failed: {r['error']}")
            continue
        ratio = {k: r[k] / base[k] for k in cols}
        compiled = r["compile_s"] is not None
        print(
            f"{name:28s} {r['step_ms']:8.1f} {ratio['step_ms']:8.2f} "
            f"{r['peak_mib']:9.1f} {ratio['peak_mib']:8.2f} "
            f"{r['peak_all_threads_mib']:9.1f} {ratio['peak_all_threads_mib']:8.2f} "
            + (f"{r['compile_s']:10.1f} {r['frames']:7d} {r['recompiles']:10d}" if compiled else "")
        )


if __name__ == "__main__":
    main()
