"""Part of ``compile``, run by hand: the first call of a compiled step with cold and with warm
caches -- two processes, one after the other, sharing one fresh inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``), as a rerun of the same job finds it.

    python -m benchmarks.compile_warm [--variants fsdp2,funcshard] [--ranks 2]

Per variant, the driver makes an empty cache directory and launches the same 2-rank job twice
(``torchrun``): the first fills the caches (cold), the second finds them (warm). Each job starts
its compiler first on a throw-away cache ([Note: the compiler's start-up is nobody's] in
``compile``), then times the variant's first step (the slowest rank) and reports the cache
counters of inductor's FX graph cache and AOTAutograd's cache and, per phase,
``torch._dynamo.utils.compile_times()``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

VARIANTS = {"fsdp2": "fsdp2 + compile", "funcshard": "funcshard + compile"}


def _phases(at_least: float = 0.2) -> dict[str, float]:
    """``compile_times()``'s phases that took ``at_least`` seconds, in its order."""
    from torch._dynamo.utils import compile_times

    names, seconds = compile_times(repr="csv", aggregate=True)
    return {
        n: round(float(s), 1) for n, s in zip(names, seconds, strict=True) if float(s) >= at_least
    }


def _job(variant: str) -> None:
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
    w = part.workload(False)
    start_up = part.warm_compiler("inductor")
    counters.clear()
    trainer = ALL[VARIANTS[variant]](w, mesh, Options(compile_backend="inductor"))
    batch = w.batch(0, ctx.rank)
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    trainer.step(batch)
    seconds = time.perf_counter() - t0
    row = {
        "first_call_s": seconds,
        "cpu_s": time.process_time() - cpu0,  # this process's, not its compile workers'
        "start_up_s": start_up,
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k or "graph" in k},
        "aot_autograd": dict(counters["aot_autograd"]),
        "phases": _phases(),
    }
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, row)
    if ctx.rank == 0:
        out = max(everyone, key=lambda r: r["first_call_s"])
        print("RESULT " + json.dumps(out, default=str), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _launch(variant: str, cache: str, ranks: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(ranks), "-m", "benchmarks.compile_warm", "--job", variant]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", default="fsdp2,funcshard")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return _job(args.job)
    print(f"load average before: {os.getloadavg()}", flush=True)
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="funcshard-inductor-") as cache:
            for run in ("cold", "warm"):
                r = _launch(variant, cache, args.ranks)
                print(
                    f"{variant} {run}: {r['first_call_s']:.1f} s (cpu {r['cpu_s']:.1f} s)  "
                    f"inductor {r['inductor']}  aot {r['aot_autograd']}  "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                print(f"  phases: {r['phases']}", flush=True)


if __name__ == "__main__":
    main()
