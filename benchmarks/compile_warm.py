"""Part of ``compile``, run by hand: the first call of a compiled step with cold and with warm
caches, and how it grows with depth -- each variant in 2-rank jobs of their own, side by side.

    python -m benchmarks.compile_warm [--variants fsdp2,jit,compile] [--rounds 2] [--ranks 2]
                                      [--layers 8] [--depth 4,16] [--cpu]

Per round, per variant (in turn, so that the machine's load falls on all of them alike): an
empty inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``) and the same job twice, the first
filling the caches (cold), the second finding them (warm), as a rerun of the job finds them.
With ``--depth``, per round and variant, a cold job at each depth (an empty directory each).
Each job starts its compiler first on a throw-away cache ([Note: the compiler's start-up is
nobody's] in ``compile``), then times the variant's first step (the slowest rank) and reports
the cache counters of inductor's FX graph cache and AOTAutograd's cache, the seconds per phase
(``torch._dynamo.utils.compile_times()``; for ``fs.jit``, its trace and its compilation), and
the rank's CPU seconds (its own, and with ``--cpu`` those of the compilers it ran: inductor
then compiles C++ in the rank's process, ``TORCHINDUCTOR_COMPILE_THREADS=1``, so that the
compilers' seconds are counted -- on a machine shared with other jobs, CPU seconds move much
less with the load than the wall time does). The ratios to ``fsdp2`` (FSDP2 with each block
compiled before ``fully_shard``, torchtitan's way) are per round, then the median over rounds.

Variants: ``fsdp2`` (FSDP2 + ``torch.compile`` per block), ``fsdp2-model`` (FSDP2 +
``torch.compile(model)``), ``compile`` (funcshard, ``torch.compile(step, fullgraph=True)``),
``jit`` (funcshard, ``fs.jit(step)``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

VARIANTS = {
    "fsdp2": "fsdp2 + compile per block",
    "fsdp2-model": "fsdp2 + compile",
    "compile": "funcshard + compile",
    "jit": "funcshard + fs.jit",
}
BASELINE = "fsdp2"


def _phases(at_least: float = 0.2) -> dict[str, float]:
    """``compile_times()``'s phases that took ``at_least`` seconds, in its order."""
    from torch._dynamo.utils import compile_times

    names, seconds = compile_times(repr="csv", aggregate=True)
    return {
        n: round(float(s), 1) for n, s in zip(names, seconds, strict=True) if float(s) >= at_least
    }


def _children() -> float:
    """CPU seconds of this process's finished children (the C++ compilers it ran itself)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _job(variant: str, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from . import compile as part
    from . import harness
    from .variants import VARIANTS as ALL
    from .variants import Options

    warnings.filterwarnings("ignore", message=".*(returned a view tensor|Full backward hook).*")
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    ctx = harness.Context(mesh, torch.device("cpu"), False, 1, 0)
    w = part.workload(False, layers=layers)
    start_up = part.warm_compiler("inductor")
    counters.clear()
    trainer = ALL[VARIANTS[variant]](w, mesh, Options(compile_backend="inductor"))
    batch = w.batch(0, ctx.rank)
    dist.barrier()
    t0, cpu0, children0 = time.perf_counter(), time.process_time(), _children()
    trainer.step(batch)
    seconds = time.perf_counter() - t0
    row = {
        "first_call_s": seconds,
        "cpu_s": time.process_time() - cpu0,  # this process's, not its compile workers'
        "compilers_cpu_s": _children() - children0,  # the compilers it waited for
        "start_up_s": start_up,
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k or "graph" in k},
        "aot_autograd": dict(counters["aot_autograd"]),
        "phases": _phases(),
    }
    jitted = getattr(trainer.counter, "jitted", None)
    if jitted is not None:
        row["jit"] = {k: round(v, 1) for k, v in jitted.seconds()[0].items()}
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, row)
    if ctx.rank == 0:
        out = max(everyone, key=lambda r: r["first_call_s"])
        print("RESULT " + json.dumps(out, default=str), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _launch(variant: str, cache: str, ranks: int, layers: int, cpu: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    if cpu:  # the C++ compilers run by the rank itself: their seconds are its children's
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(ranks), "-m", "benchmarks.compile_warm", "--job", variant, "--layers", str(layers)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["load"] = round(os.getloadavg()[0], 1)
    return result


def _show(label: str, r: dict) -> None:
    jit = f"  fs.jit {r['jit']}" if "jit" in r else ""
    print(
        f"{label}: {r['first_call_s']:.1f} s (cpu {r['cpu_s']:.1f} s, compilers "
        f"{r['compilers_cpu_s']:.1f} s){jit}  inductor "
        f"{r['inductor']}  aot {r['aot_autograd']}  load {r['load']}\n  phases: {r['phases']}",
        flush=True,
    )


def _cpu(r: dict) -> float:
    return r["cpu_s"] + r["compilers_cpu_s"]


def _ratios(times: dict, what: str) -> None:
    """Per variant, the median over rounds of its time over the baseline's in the same round."""
    if BASELINE not in times:
        return
    for variant, seconds in times.items():
        if variant == BASELINE:
            continue
        per_round = [s / b for s, b in zip(seconds, times[BASELINE], strict=True)]
        shown = ", ".join(f"{x:.2f}" for x in per_round)
        print(f"{what}: {variant} / {BASELINE}: median {statistics.median(per_round):.2f}x "
              f"(rounds: {shown})", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", default="fsdp2,jit")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8, help="blocks of the cold/warm runs")
    ap.add_argument("--depth", default="", help="e.g. 4,16: cold first calls at these depths")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="compile C++ in the ranks (1 thread) and compare CPU seconds too",
    )
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return _job(args.job, args.layers)
    variants = args.variants.split(",")
    depths = [int(d) for d in args.depth.split(",") if d]
    print(f"load average before: {os.getloadavg()}", flush=True)
    cold, warm = {v: [] for v in variants}, {v: [] for v in variants}
    cold_cpu, warm_cpu = {v: [] for v in variants}, {v: [] for v in variants}
    deep = {(v, d): [] for v in variants for d in depths}
    deep_cpu = {(v, d): [] for v in variants for d in depths}
    for r in range(args.rounds):
        for variant in variants:
            if not depths:
                with tempfile.TemporaryDirectory(prefix="funcshard-inductor-") as cache:
                    for run, into, into_cpu in (("cold", cold, cold_cpu),
                                                ("warm", warm, warm_cpu)):  # fmt: skip
                        result = _launch(variant, cache, args.ranks, args.layers, args.cpu)
                        into[variant].append(result["first_call_s"])
                        into_cpu[variant].append(_cpu(result))
                        _show(f"round {r} {variant} {run}, {args.layers} blocks", result)
            for d in depths:
                with tempfile.TemporaryDirectory(prefix="funcshard-inductor-") as cache:
                    result = _launch(variant, cache, args.ranks, d, args.cpu)
                    deep[variant, d].append(result["first_call_s"])
                    deep_cpu[variant, d].append(_cpu(result))
                    _show(f"round {r} {variant} cold, {d} blocks", result)
    if not depths:
        _ratios(cold, "cold, wall")
        _ratios(warm, "warm, wall")
        _ratios(cold_cpu, "cold, CPU")
        _ratios(warm_cpu, "warm, CPU")
    for variant in variants:
        for times, what in ((deep, "wall"), (deep_cpu, "CPU")):
            if len(depths) < 2:
                continue
            first, last = times[variant, depths[0]], times[variant, depths[-1]]
            ratios = [b / a for a, b in zip(first, last, strict=True)]
            shown = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"depth, {what}: {variant}, {depths[-1]} / {depths[0]} blocks: median "
                  f"{statistics.median(ratios):.2f}x (rounds: {shown})", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
