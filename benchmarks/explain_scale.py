"""Part ``explain``: ``fs.explain`` of Llama steps at 8 to 1024 ranks, without the machines.

Llama shapes built on meta (fp32 master parameters, bf16 compute, fp32 gradient reduction, a
group per block plus the embedding and the head, AdamW), sharded over a fake process group;
one rank's step on fake tensors at batch 1 (token ids ``(1, seq)``, cross-entropy of the
float32 logits). Per model and world size: the wall time of one explain, its predicted peak
per rank, and the largest batch within 80 GB (``--budget``) per rank from
``_explain_scale.largest_batch`` (its explains and their total time). 8B and 70B also with
every block recomputing its forward in backward (``recompute``). Explain times at batch 1:
the first run (fake tensors' dispatch caches cold) and the same run again.

    python -m benchmarks.explain_scale [--quick] [--seq 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import funcshard as fs
from funcshard._pricing._explain_cli import step_explainer
from funcshard._pricing._explain_scale import largest_batch, parse_bytes
from funcshard._pricing._fake_world import fake_world

from .workloads import LLAMA_SHAPES, LlamaBlock, count, meta_llama

# (layers, width, MLP hidden, vocab, key/value width): LLAMA_SHAPES' 1B and 70B (Llama-2
# vocabulary); 8B is Llama-3-8B's (vocabulary 128256, grouped-query attention)
SHAPES = {
    "1B": LLAMA_SHAPES["1B"],
    "8B": (32, 4096, 14336, 128256, 1024),
    "70B": LLAMA_SHAPES["70B"],
}
WORLDS = (8, 64, 1024)
BUDGET = "80GB"


def policy() -> fs.policy.Policy:
    return fs.policy.any_of(fs.policy.by_type(LlamaBlock), fs.policy.by_names(["embed", "head"]))


def row(
    name: str, shape, world: int, seq: int, budget: float, recompute: bool = False
) -> dict[str, Any]:
    model = meta_llama(*shape)
    with fake_world(world) as mesh:
        t0 = time.perf_counter()
        make = step_explainer(model, mesh, seq=seq, group_policy=policy(), recompute=recompute)
        setup_s = time.perf_counter() - t0
        runs: dict[int, tuple[int, float]] = {}

        def timed(b: int):
            t = time.perf_counter()
            e = make(b)
            runs[b] = e.peak_bytes, time.perf_counter() - t
            return e

        t1 = time.perf_counter()
        make(1)
        first_s = time.perf_counter() - t1
        first = timed(1)
        best = largest_batch(timed, budget)
    return {
        "model": name,
        "recompute": recompute,
        "parameters": count(model),
        "world": world,
        "seq": seq,
        "setup_s": setup_s,  # plan (dry run on meta), schedule, shard
        "first_explain_s": first_s,  # fake-tensor caches cold
        "explain_s": runs[1][1],  # the same step again
        "operators": first.operators,
        "peak_gib": first.peak_bytes / 2**30,
        "at_peak": {k: v / 2**30 for k, v in first.at_peak.items() if v},
        "peak_at": f"{first.peak_at.step.op} {first.peak_at.step.group}",
        "predicted_step_s": first.predicted_step_s,
        "largest_batch": best,
        "search_explains": len(runs),
        "search_s": sum(s for _, s in runs.values()),
        "peak_gib_by_batch": {b: p / 2**30 for b, (p, _) in sorted(runs.items())},
        "explain_s_by_batch": {b: t for b, (_, t) in sorted(runs.items())},
    }


def run(quick: bool, seq: int = 4096, budget: str = BUDGET) -> dict[str, Any]:
    if quick:  # a model of kilobytes: a budget it reaches at a batch of tens
        cases = [("tiny", (2, 128, 256, 256, 128), w, r) for w in (8, 1024) for r in (0, 1)]
        seq, budget = 64, "32MB"
    else:
        cases = [(n, s, w, False) for n, s in SHAPES.items() for w in WORLDS]
        cases += [(n, SHAPES[n], w, True) for n in ("8B", "70B") for w in WORLDS]
    limit = parse_bytes(budget)
    rows = []
    for name, shape, world, recompute in cases:
        rows.append(row(name, shape, world, seq, limit, bool(recompute)))
        r = rows[-1]
        print(
            f"[explain_scale] {name}{' recompute' if recompute else ''} world {world}: explain "
            f"{r['explain_s']:.1f} s, peak "
            f"{r['peak_gib']:.2f} GiB, largest batch {r['largest_batch']} "
            f"({r['search_explains']} explains, {r['search_s']:.1f} s)",
            flush=True,
        )
    return {
        "rows": rows,
        "budget": budget,
        "param_dtype": "fp32",
        "compute_dtype": "bf16",
        "reduce_dtype": "fp32",
        "hardware": "H100 (nominal)",
        "torch": torch.__version__,
    }


def section(results: dict[str, Any]) -> str:
    """The generated block of BENCHMARKS.md (``<!-- bench:explain_scale -->``)."""
    from .tables import measured, table

    r = results.get("explain_scale")
    if r is None:
        return ""
    res = r["result"]
    rows = [
        [
            row["model"] + (" + recompute" if row["recompute"] else ""),
            f"{row['parameters'] / 1e9:.2f}B",
            row["world"],
            f"{row['first_explain_s']:.1f} / {row['explain_s']:.1f}",
            f"{row['operators']}",
            f"{row['peak_gib']:.1f}",
            row["peak_at"],
            row["largest_batch"],
            f"{row['search_explains']} / {row['search_s']:.0f}",
        ]
        for row in res["rows"]
    ]
    head = [
        "model",
        "parameters",
        "world",
        "explain s: first / again",
        "operators",
        "peak GiB (batch 1)",
        "peak at",
        f"largest batch in {res['budget']}",
        "search: explains / s",
    ]
    seq = res["rows"][0]["seq"] if res["rows"] else 0
    return "\n\n".join(
        [
            f"Sequence {seq}, fp32 parameters and AdamW state, {res['compute_dtype']} compute, "
            f"{res['reduce_dtype']} reduction; one rank's step on fake tensors.",
            table(head, rows),
            measured(r) + "\n",
        ]
    )


def main() -> None:
    from . import harness

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = run(args.quick, args.seq)
    info = {
        "part": "explain_scale",
        "quick": args.quick,
        "machine": harness.machine(torch.device("cpu")),
        "load_average_after": harness.machine(torch.device("cpu"))["load_average"],
        "seconds": time.perf_counter() - t0,
        "result": result,
    }
    from pathlib import Path

    out = Path(args.out) if args.out else harness.RESULTS / ("quick" if args.quick else "")
    print(f"[explain_scale] {info['seconds']:.0f} s -> {harness.write('explain_scale', info, out)}")


if __name__ == "__main__":
    main()
