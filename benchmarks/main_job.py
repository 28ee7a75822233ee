"""Part ``main_job``: ``examples/train_llama.py`` on one GPU, in each of its modes, one after
another in this process (the example's ``main``, one NCCL rank).

The size keeps an H100 busy: width 2048, 16 blocks, 16 heads (823M parameters), 16 sequences
of 1024 tokens per step, ``STEPS`` steps of the default bf16 step (fp32 master weights and
reduction, fused AdamW, clipping, a warm-up cosine schedule). The modes, most telling first:
eager, ``--cuda-graph``, ``--recompute``, ``--compile``, and eager again (the eager step's own
run-to-run differences). Per mode: tokens/s (without the first three steps: compilation,
warm-up and capture) and the example's MFU (6 x parameters x tokens/s over ``--peak-tflops``:
attention not counted), and its losses against eager's: ``--cuda-graph`` replays the eager
step's kernels and ``--recompute`` runs the same forward again, so both must equal eager's bit
for bit where eager repeats itself; ``--compile`` runs other kernels (inductor's), so its
losses follow eager's to bf16's rounding. ``main_job-<device>.json`` is rewritten after each
mode.

    python -m benchmarks.main_job                       # on the GPU (about 1.5 minutes)
    python -m benchmarks.main_job --quick --device cpu  # tiny, gloo
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import harness

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_llama  # the main job

MODES = {
    "eager": [],
    "cuda graph": ["--cuda-graph"],
    "recompute": ["--recompute"],
    "compile": ["--compile"],
    "eager again": [],
}
STEPS = 20
SIZE = ["--width", "2048", "--depth", "16", "--heads", "16", "--context", "1024",
        "--batch", "16", "--steps", str(STEPS), "--warmup", "5"]  # fmt: skip
TINY = ["--width", "32", "--depth", "2", "--heads", "2", "--context", "32", "--batch", "4",
        "--steps", "5", "--warmup", "1", "--data-mb", "0.1"]  # fmt: skip


def run_mode(argv: list[str]) -> dict[str, Any]:
    """The example's ``main(argv)`` as rank 0 of a one-rank job (its own process group)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": os.environ.get("MASTER_PORT", "29541")}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        out = train_llama.main(argv)
        return out | {"seconds": time.perf_counter() - t0}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare(rows: dict[str, dict[str, Any]]) -> None:
    """Each mode's largest loss difference from eager's: absolute and relative (in place)."""
    base = rows.get("eager", {}).get("losses")
    for row in rows.values():
        losses = row.get("losses")
        if base and losses and len(losses) == len(base):
            diffs = [abs(a - b) for a, b in zip(losses, base, strict=True)]
            row["loss_diff"] = max(diffs)
            row["loss_rel_diff"] = max(d / abs(b) for d, b in zip(diffs, base, strict=True))


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    ap.add_argument("--modes", help=f"comma-separated, of {list(MODES)} (default: all)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 peak of one device")
    ap.add_argument("--out", type=Path, help="results folder")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    modes = args.modes.split(",") if args.modes else list(MODES)
    if set(modes) - set(MODES):
        ap.error(f"unknown --modes {sorted(set(modes) - set(MODES))}; known: {list(MODES)}")
    if device.type != "cuda":
        modes = [m for m in modes if m != "cuda graph"]  # refused without CUDA
    size = TINY if args.quick else SIZE
    common = [*size, "--device", args.device, "--peak-tflops", str(args.peak_tflops)]
    out = args.out or (harness.RESULTS / "quick" if args.quick else harness.RESULTS)
    rows: dict[str, dict[str, Any]] = {}
    info = {"part": "main_job", "quick": args.quick, "machine": harness.machine(device),
            "argv": common, "peak_tflops": args.peak_tflops, "result": rows}  # fmt: skip
    path = out
    for mode in modes:
        try:
            row = run_mode([*common, *MODES[mode]])
            if device.type == "cuda":
                speed = 6 * row["parameters"] * row["tokens_per_s"]
                row["mfu"] = speed / (args.peak_tflops * 1e12)
        except Exception as e:  # recorded, never fatal to the other modes
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        rows[mode] = row
        compare(rows)
        info["load_average_after"] = harness.machine(device)["load_average"]
        path = harness.write(f"main_job-{device.type}", info, out)
        said = row.get("error") or (
            f"{row['tokens_per_s']:,.0f} tokens/s, loss {row['losses'][0]:.3f} -> "
            f"{row['losses'][-1]:.3f}, {row['seconds']:.0f} s"
        )
        print(f"[main_job] {mode}: {said}", flush=True)
    print(f"[main_job] -> {path}")
    return path


def section(results: dict[str, Any]) -> str:
    """The generated block of BENCHMARKS.md (``<!-- bench:main_job -->``): the GPU's run."""
    from .tables import measured, table

    r = results.get("main_job-cuda")
    if r is None:
        return "*No result yet: pending a run on the GPU machine (`benchmarks/gpu_check.sh`).*\n"
    rows = []
    for mode, row in r["result"].items():
        if "error" in row:
            rows.append([mode, f"failed: `{row['error'][:200]}`", "-", "-", "-"])
            continue
        diff = row.get("loss_diff")
        rows.append([
            mode,
            f"{row['tokens_per_s']:,.0f}",
            f"{row['mfu']:.1%}" if row.get("mfu") is not None else "-",
            f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}",
            "-" if diff is None else f"{diff:.1e} ({row['loss_rel_diff']:.1e} relative)",
        ])  # fmt: skip
    head = [
        "mode",
        "tokens/s",
        "MFU",
        "loss, first -> last step",
        "largest loss difference from eager",
    ]
    said = f"`examples/train_llama.py {' '.join(r['argv'])}` (one GPU, NCCL), per mode:"
    return "\n\n".join([said, table(head, rows), measured(r)]) + "\n"


if __name__ == "__main__":
    main()
