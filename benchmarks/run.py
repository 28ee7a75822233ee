"""The benchmark suite's driver: ``make bench`` (= ``python -m benchmarks.run``).

    python -m benchmarks.run [--quick]
        [--only step,memory,comms,overhead,timeline,compile,recompute,explain,scale,
               explain_scale,gpu]
                             [--device cpu|cuda] [--ranks 2,4] [--out DIR] [--no-report]

Parts that need ranks run under ``torchrun`` (one launch per world size, all its parts in
it); ``scale``, ``explain_scale`` (``fs.explain`` of Llama steps over fake worlds,
``explain_scale.py``) and the fake-process-group half of ``overhead`` run in this process.
Results go to ``benchmarks/results/*.json`` (``--quick``: ``benchmarks/results/quick/``); the
report then regenerates the tables and plots of ``BENCHMARKS.md`` from them (``--quick``
writes its own ``BENCHMARKS.md`` into its results folder and leaves the repository's alone).

``--device cuda`` runs the same parts with NCCL, one rank per GPU (``--ranks`` at most the
GPU count). Part ``gpu`` (the training step on one GPU, ``gpu.py``) runs only when ``--only``
names it, in a process of its own (one rank; ``--device cpu --quick``: a tiny model on gloo).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from . import harness

RANK_PARTS = ("step", "memory", "comms", "overhead", "timeline", "compile", "recompute", "explain")
LOCAL_PARTS = ("scale", "explain_scale", "overhead")
OWN_PROCESS = ("gpu",)  # python -m benchmarks.<part>: its own one-rank process group
EVERY_WORLD = ("step", "comms", "explain")  # the others run on the smallest world size only


def launches(parts: list[str], ranks: list[int]) -> list[tuple[int, list[str]]]:
    """``(world size, parts)`` per torchrun launch."""
    out = []
    for i, world in enumerate(sorted(ranks)):
        mine = [p for p in parts if p in RANK_PARTS and (i == 0 or p in EVERY_WORLD)]
        if mine:
            out.append((world, mine))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models, 2 ranks: under a minute")
    ap.add_argument("--only", help="comma-separated parts (default: all)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ranks", help="comma-separated world sizes (default 2,4; --quick: 2)")
    ap.add_argument("--rounds", type=int, default=10, help="measured steps per variant")
    ap.add_argument("--out", type=Path, help="results folder")
    ap.add_argument("--no-report", action="store_true", help="skip tables and plots")
    args = ap.parse_args(argv)

    parts = args.only.split(",") if args.only else [*RANK_PARTS, "scale", "explain_scale"]
    known = {*RANK_PARTS, *LOCAL_PARTS, *OWN_PROCESS}
    unknown = sorted(set(parts) - known)
    if unknown:
        ap.error(f"unknown parts {unknown}; parts are {sorted(known)}")
    ranks = [int(r) for r in (args.ranks or ("2" if args.quick else "2,4")).split(",")]
    out = args.out or (harness.RESULTS / "quick" if args.quick else harness.RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores: one thread each
    start = time.perf_counter()
    print(f"[bench] load average before: {os.getloadavg()}")
    for world, mine in launches(parts, ranks):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(world), "-m", "benchmarks.ranks", "--parts", ",".join(mine)]
        cmd += ["--device", args.device, "--rounds", str(args.rounds), "--out", str(out)]
        cmd += ["--quick"] if args.quick else []
        print(f"[bench] {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, env=env)
    _local(parts, args, out)
    for part in (p for p in OWN_PROCESS if p in parts):
        cmd = [
            sys.executable,
            "-m",
            f"benchmarks.{part}",
            "--device",
            args.device,
            "--out",
            str(out),
        ]
        cmd += ["--quick"] if args.quick else []
        print(f"[bench] {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, env=env)
    print(f"[bench] load average after: {os.getloadavg()}; {time.perf_counter() - start:.0f} s")
    if not args.no_report:
        from . import report

        report.main(out, repository=not args.quick and args.out is None)


def _local(parts: list[str], args, out: Path) -> None:
    import torch

    device = torch.device("cpu")
    for part in LOCAL_PARTS:
        if part not in parts:
            continue
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        t0, before = time.perf_counter(), harness.machine(device)
        if part == "scale":
            from . import scale

            result, name = scale.run(args.quick), "scale"
        elif part == "explain_scale":
            from . import explain_scale

            result, name = explain_scale.run(args.quick), "explain_scale"
        else:
            from . import overhead

            result, name = overhead.run_fake(args.quick, args.rounds, 2), "overhead-fake"
        info = {
            "part": name,
            "quick": args.quick,
            "machine": before,
            "load_average_after": harness.machine(device)["load_average"],
            "seconds": time.perf_counter() - t0,
            "result": result,
        }
        print(f"[bench] {name}: {info['seconds']:.0f} s -> {harness.write(name, info, out)}")


if __name__ == "__main__":
    main()
