"""The 8B step's block of BENCHMARKS.md (``<!-- bench:gpu_8b -->``), from ``gpu_8b``'s results
(``gpu8b-<device>.json``) and ``gpu_8b_explain``'s (``gpu8b-predict-``, ``gpu8b-check-``): the
rows of each set with explain's exposed communication beside them, the targets, explain's
prediction beside torchtitan's published numbers, and explain's check."""

from __future__ import annotations

from typing import Any

from .gpu_8b import BASELINE, BLOCKS, FULL, TARGET_GIB, TARGET_TOKENS, TORCHTITAN
from .tables import measured, table

GiB = 2**30
HEADER = ["variant", "recompute", "step s", "tokens/s per GPU", "MFU", "x FSDP2 + compile",
          "peak allocated GiB", "reserved GiB", "first step s", "GPU busy",
          "exposed comm. s (explain)", "tokens/s with it"]  # fmt: skip


def _found(results: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The GPU's result of ``kind`` (``gpu8b``, ``gpu8b-predict``, ``gpu8b-check``), else the
    CPU's."""
    return results.get(f"{kind}-cuda") or results.get(f"{kind}-cpu")


def _recompute(form: str, keep: int) -> str:
    return {FULL: "every block", BLOCKS: f"all but the last {keep} blocks"}.get(
        form, "torchtitan's, by operator"
    )


def _exposed(row: dict[str, Any], predicted: dict[str, Any]) -> float | None:
    """Explain's exposed communication for 8 real ranks: of funcshard's plan with the row's
    recompute form (FSDP2 by operator: every block's, its collectives being the same)."""
    form = row["recompute"] if row["recompute"] in (FULL, BLOCKS) else FULL
    return predicted.get("forms", {}).get(form, {}).get("exposed_communication_s")


def _cells(row: dict[str, Any], keep: int, predicted: dict[str, Any]) -> list[str]:
    how = _recompute(row["recompute"], keep)
    if "ms" not in row:
        if "skipped" in row:
            said = f"skipped: {row['skipped']}"
        elif "error" in row:
            said = f"failed ({row['phase']}): `{row['error']}`"
        else:
            said = "not timed: the run ended first"
        first = f"{row['first_call_s']:.1f}" if "first_call_s" in row else "-"
        return [how, said, *["-"] * 5, first, *["-"] * 3]
    num = lambda x, f: "-" if x is None else f.format(x)
    exposed = _exposed(row, predicted)
    with_it = (
        None if exposed is None else row["tokens_per_s"] * row["ms"] / (row["ms"] + 1e3 * exposed)
    )
    return [
        how,
        f"{row['ms'] / 1e3:.2f}",
        f"**{row['tokens_per_s']:,.0f}**",
        num(row.get("mfu"), "{:.1%}"),
        num(row.get("x_baseline"), "{:.2f}"),
        num(row.get("peak_bytes") and row["peak_bytes"] / GiB, "{:.1f}"),
        num(row.get("reserved_bytes") and row["reserved_bytes"] / GiB, "{:.1f}"),
        f"{row['first_call_s']:.1f}",
        num(row.get("busy"), "{:.0%}"),
        num(exposed, "{:.3f}"),
        num(with_it, "{:,.0f}"),
    ]


def best(result: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """funcshard's fastest measured variant whose peak fits ``TARGET_GIB``: (set: label, row)."""
    fits = [
        (f"{name}: {label}", row)
        for name, rows in result["sets"].items()
        for label, row in rows.items()
        if label.startswith("funcshard") and "tokens_per_s" in row
        and row.get("peak_bytes", float("inf")) <= TARGET_GIB * GiB
    ]  # fmt: skip
    return max(fits, key=lambda x: x[1]["tokens_per_s"], default=None)


def baseline(result: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest FSDP2 + compile per block measured (any set)."""
    rows = [
        rows[BASELINE]
        for rows in result["sets"].values()
        if "tokens_per_s" in rows.get(BASELINE, {})
    ]
    return max(rows, key=lambda row: row["tokens_per_s"], default=None)


def targets(result: dict[str, Any]) -> list[list[Any]]:
    """``[what, target, measured, met]``: funcshard's fastest within 77 GiB against 7,300
    tokens/s and against FSDP2 + compile's fastest in the same process."""
    found, theirs = best(result), baseline(result)
    if found is None:
        return [["8B: funcshard's fastest within 77 GiB", f">= {TARGET_TOKENS:,} tokens/s",
                 "not measured", "-"]]  # fmt: skip
    label, row = found
    out = [[f"8B: {label}", f">= {TARGET_TOKENS:,} tokens/s per GPU within {TARGET_GIB:g} GiB",
            f"{row['tokens_per_s']:,.0f} ({row['peak_bytes'] / GiB:.1f} GiB)",
            "yes" if row["tokens_per_s"] >= TARGET_TOKENS else "**no**"]]  # fmt: skip
    if theirs is not None:
        x = row["tokens_per_s"] / theirs["tokens_per_s"]
        out.append([f"8B: {label}", "ahead of FSDP2 + compile per block (same process)",
                    f"{x:.2f}x its {theirs['tokens_per_s']:,.0f} tokens/s",
                    "yes" if x > 1 else "**no**"])  # fmt: skip
    return out


def anchor(predicted: dict[str, Any]) -> str:
    """torchtitan's published rows beside explain's prediction of the same configuration."""
    rows = [[f"torchtitan: {k} (8 H100s, selective AC by operator)", f"{t:,}", f"{m}"]
            for k, (t, m) in TORCHTITAN.items()]  # fmt: skip
    keep, tokens = predicted["keep"], predicted["tokens"]
    for form, e in predicted["forms"].items():
        rows.append([
            f"fs.explain: funcshard, {_recompute(form, keep)} recomputed, {e['hardware']}",
            f"{tokens / e['predicted_step_s']:,.0f} ({e['predicted_step_s']:.2f} s: compute "
            f"{e['compute_s']:.2f} + exposed comm. {e['exposed_communication_s']:.3f})",
            f"{e['peak_bytes'] / GiB:.1f} (at {e['peak_at']})",
        ])  # fmt: skip
    return table(["", "tokens/s per GPU", "memory GiB"], rows)


def check(c: dict[str, Any]) -> str:
    """Explain's check: the measured peak and step against the predictions."""
    if "measured_peak_bytes" not in c:
        return ""
    said = [
        f"funcshard eager, every block recomputed: peak ({c['peak_measured_by']}) "
        f"{c['measured_peak_bytes'] / GiB:.2f} GiB, step {c['measured_step_s']:.2f} s"
    ]
    for rates in ("h100", "measured"):
        if "error" in c.get(rates, {}):
            said.append(f"explain with {rates} rates failed: `{c[rates]['error']}`")
        elif rates in c:
            e = c[rates]
            said.append(
                f"explain with {e['hardware']} rates: peak {e['peak_bytes'] / GiB:.2f} GiB "
                f"(**{e['peak_error']:+.1%}**, target within 5%), compute lane "
                f"{e['compute_s']:.2f} s (**{e['step_error']:+.0%}**, target within 20%)"
            )
    return "Explain's check: " + "; ".join(said) + "."


def section(results: dict[str, Any]) -> str:
    r8, rp, rc = (_found(results, k) for k in ("gpu8b", "gpu8b-predict", "gpu8b-check"))
    predicted = rp["result"] if rp else {}
    out = []
    if r8:
        res = r8["result"]
        out.append(
            f"**{res['description']}** ({res['parameters'] / 1e9:.2f}B parameters, "
            f"{res['flop_per_token'] / 1e9:.1f} GFLOP per token): medians of {r8['rounds']} "
            f"alternating steps per set; MFU against {res['peak_tflops'] or 0:g} TFLOP/s."
        )
        for name, rows in res["sets"].items():
            cells = [[label, *_cells(row, res["keep"], predicted)] for label, row in rows.items()]
            seconds = res["set_seconds"].get(name, 0)
            out.append(f"*{name}* ({seconds:.0f} s)\n\n" + table(HEADER, cells))
        out.append(
            "Targets: " + "; ".join(f"{a}: {b}: {c} ({d})" for a, b, c, d in targets(res)) + "."
        )
        out.append(measured(r8))
    if rp:
        out.append(anchor(predicted) + "\n\n" + measured(rp))
    if rc:
        out.append(check(rc["result"]) + "\n\n" + measured(rc))
    if not out:
        return "*No result yet: pending a run on the GPU machine (`benchmarks/gpu_check.sh`).*\n"
    return "\n\n".join(out) + "\n"


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    """The 8B targets and explain's check on the GPU (CUDA results only)."""
    out = []
    r8, rc = results.get("gpu8b-cuda"), results.get("gpu8b-check-cuda")
    if r8:
        out += targets(r8["result"])
    if rc and "peak_error" in rc["result"].get("h100", {}):
        e = rc["result"]["h100"]
        met = "yes" if abs(e["peak_error"]) <= 0.05 else "**no**"
        out.append(["8B: explain's peak", "within 5% of max_memory_allocated",
                    f"{e['peak_error']:+.1%}", met])  # fmt: skip
        for rates in ("h100", "measured"):
            if "step_error" in rc["result"].get(rates, {}):
                x = rc["result"][rates]["step_error"]
                out.append([f"8B: explain's step ({rates} rates)", "within 20%", f"{x:+.0%}",
                            "yes" if abs(x) <= 0.2 else "**no**"])  # fmt: skip
    return out
