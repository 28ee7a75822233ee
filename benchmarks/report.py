"""Results (JSON) -> the tables and plots of BENCHMARKS.md.

    python -m benchmarks.report [DIR]       # regenerate from benchmarks/results/*.json

``BENCHMARKS.md`` holds prose written by people and, between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` markers, tables generated here: only those are rewritten. Every table
names the machine it was measured on.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from . import (
    explain_accuracy,
    explain_scale,
    gpu,
    gpu_8b_report,
    harness,
    main_job,
    recompute,
    scale,
)
from .tables import mark, measured, ratio, table, time_and_peak
from .timeline import LANES

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _load(folder: Path) -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def step_section(results: dict[str, Any]) -> str:
    out = []
    for key in sorted(k for k in results if k.startswith("step-")):
        r = results[key]
        res = r["result"]
        rows = [
            [
                row["variant"],
                row["param_dtype"] + (" / fp32 reduce" if row["param_dtype"] != "fp32" else ""),
                "on" if row["reshard_after_forward"] else "off",
                f"{row['fsdp2_ms']:.0f}",
                f"{row['funcshard_ms']:.0f}",
                f"**{row['ratio']:.2f}**",
                mark(row["ratio"] <= 0.9),
                f"{row['loss_gap']:.1e}",
            ]
            for row in res["rows"]
        ]
        out.append(
            f"**{r['world']} ranks**: {res['workload']['description']} "
            f"({res['workload']['parameters'] / 1e6:.1f}M parameters), "
            f"medians of {r['rounds']} steps after {r['warmup']} warm-up steps.\n"
        )
        out.append(
            table(
                [
                    "variant",
                    "params",
                    "reshard after forward",
                    "FSDP2 ms",
                    "variant ms",
                    "variant / FSDP2",
                    "<= 0.9x",
                    "loss gap",
                ],
                rows,
            )
        )
        out.append(measured(r) + "\n")
    return "\n\n".join(out)


def memory_section(results: dict[str, Any]) -> str:
    r = next((v for k, v in sorted(results.items()) if k.startswith("memory-")), None)
    if r is None:
        return ""
    res, out = r["result"], []
    for t in res["tables"]:
        labels = list(t["rows"])
        rows_ = t["rows"]
        base = rows_[labels[0]]
        rows = [
            [c, *(f"{rows_[v]['at_peak_all'][c] / MiB:.1f}" for v in labels)]
            for c in res["categories"]
        ]
        lines = (
            ("peak, all threads", lambda x: x["peak_all"]),
            ("peak, own thread", lambda x: x["peak_own"]),
            ("above the step's start, all threads", lambda x: x["peak_all"] - x["resident"]),
        )
        for title, get in lines:
            cells = [
                f"**{get(rows_[v]) / MiB:.1f}** ({get(rows_[v]) / get(base):.2f}x)" for v in labels
            ]
            rows.append([f"**{title}**", *cells])
        spread = [
            f"{rows_[v]['peak_all_range'][0] / MiB:.0f}-{rows_[v]['peak_all_range'][1] / MiB:.0f}"
            for v in labels
        ]
        rows.append([f"all-threads peak over {t['steps']} steps", *spread])
        out.append(
            f"**{t['workload']['description']}**, {t['param_dtype']} parameters "
            f"({t['workload']['parameters'] / 1e6:.1f}M): MiB per rank at the all-threads peak "
            f"of the step with the median peak of {t['steps']}"
        )
        out.append(table(["category", *labels], rows))
    out.append(measured(r) + "\n")
    return "\n\n".join(out)


def comms_section(results: dict[str, Any]) -> str:
    out = []
    for key in sorted(k for k in results if k.startswith("comms-")):
        r = results[key]
        rows = []
        for row in r["result"]["rows"]:
            for name in ("fsdp2", "funcshard"):
                c = row[name]["collectives"]
                rows.append(
                    [
                        "FSDP2" if name == "fsdp2" else "funcshard",
                        row["param_dtype"],
                        "on" if row["reshard_after_forward"] else "off",
                        c.get("all_gather", 0),
                        c.get("reduce_scatter", 0),
                        f"{row[name]['mib']:.2f}",
                        f"{row['bound_mib']:.2f}",
                        ratio(row[name]["x_bound"]),
                    ]
                )
        out.append(f"**{r['world']} ranks**, {r['result']['workload']['description']}:")
        out.append(
            table(
                [
                    "",
                    "params",
                    "reshard",
                    "all-gathers",
                    "reduce-scatters",
                    "MiB sent per rank",
                    "lower bound MiB",
                    "x bound",
                ],
                rows,
            )
        )
        out.append(measured(r) + "\n")
    return "\n\n".join(out)


def _overhead_tables(r: dict[str, Any]) -> list[str]:
    out = []
    for t in r["result"]["tables"]:
        rows = [
            [label, f"{v['ms']:.1f}", f"**{v['ratio']:.2f}**"] for label, v in t["rows"].items()
        ]
        out.append(f"*{t['workload']['description']}*")
        out.append(table(["", "step ms", "x FSDP2"], rows))
    return out


def overhead_section(results: dict[str, Any]) -> str:
    out = []
    real = next(
        (v for k, v in sorted(results.items()) if k.startswith("overhead-") and "ranks" in k), None
    )
    if real:
        out.append("On real ranks (gloo):")
        out += _overhead_tables(real)
        out.append(measured(real))
    fake = results.get("overhead-fake")
    if fake:
        out.append(
            "\nIn one process over a fake 2-rank process group (no communication: the "
            "frameworks' own CPU work):"
        )
        out += _overhead_tables(fake)
        out.append(measured(fake))
    return "\n\n".join(out) + "\n"


def merged_plans_section(results: dict[str, Any]) -> str:
    r = next((v for k, v in sorted(results.items()) if k.startswith("overhead-")), None)
    if r is None:
        return ""
    out = []
    for t in r["result"]["tables"]:
        for label, groups in t.get("merged_plans", {}).items():
            names = ", ".join(f"`{name}` ({n} params)" for name, n in groups[:6])
            more = f", ... ({len(groups)} groups)" if len(groups) > 6 else ""
            out.append(f"- {t['workload']['name']}, {label}: {names}{more}")
    return "\n".join(out) + "\n"


def scale_section(results: dict[str, Any], folder: Path, images: str) -> str:
    r = results.get("scale")
    if r is None:
        return ""
    res = r["result"]
    plot_scale(res, folder)
    rows = [
        [
            row["model"],
            f"{row['parameters'] / 1e9:.2f}B",
            row["world"],
            f"{row['shard_gib']:.3f}",
            f"{row['window_gib']:.2f}",
            f"{row['per_rank_gib']:.2f}",
            f"{row['formula_gib']:.2f}",
        ]
        for row in res["memory"]
    ]
    timing = res["timing"]
    xs = [t["parameters"] for t in timing]
    fits = {k: scale.linear_fit(xs, [t[k] for t in timing]) for k in ("plan_ms", "shard_ms")}
    trows = [
        [
            t["layers"],
            f"{t['parameters'] / 1e9:.2f}B",
            t["tensors"],
            f"{t['plan_ms']:.1f}",
            f"{t['shard_ms']:.1f}",
        ]
        for t in timing
    ]
    return "\n\n".join(
        [
            table(
                [
                    "model",
                    "parameters",
                    "world",
                    "shard GiB",
                    "window GiB",
                    "per rank GiB",
                    "P/W + window GiB",
                ],
                rows,
            ),
            f"![per-rank parameter memory]({images}/scale_memory.png)",
            table(
                ["layers", "parameters", "tensors", "fs.plan ms", "fs.shard ms (meta, 8 ranks)"],
                trows,
            ),
            f"Linear fits against the parameter count: `fs.plan` R^2 = {fits['plan_ms'][2]:.3f}, "
            f"`fs.shard` R^2 = {fits['shard_ms'][2]:.3f}.",
            f"![plan and shard time]({images}/scale_time.png)",
            measured(r) + "\n",
        ]
    )


def timeline_section(results: dict[str, Any], folder: Path, images: str) -> str:
    r = next((v for k, v in sorted(results.items()) if k.startswith("timeline-")), None)
    if r is None:
        return ""
    res = r["result"]
    paths = plot_timeline(res, folder)
    rows = []
    for label, ranks in res["frameworks"].items():
        for rank, t in enumerate(ranks):
            rows.append(
                [
                    label,
                    rank,
                    f"{t['duration_ms']:.0f}",
                    f"{t['comm_ms']:.0f}",
                    f"{100 * t['comm_overlapped']:.0f}%",
                ]
            )
    out = [table(["", "rank", "step ms", "gloo transfer ms", "transfer under compute"], rows)]
    out += [f"![timeline rank {i}]({images}/{p.name})" for i, p in enumerate(paths)]
    out.append(measured(r) + "\n")
    return "\n\n".join(out)


def plot_timeline(res: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "compute": "tab:blue",
        LANES[1]: "tab:gray",
        "all-gather": "tab:green",
        "reduce-scatter": "tab:orange",
    }
    frameworks = res["frameworks"]
    world = len(next(iter(frameworks.values())))
    paths = []
    for rank in range(world):
        span = max(frameworks[f][rank]["duration_ms"] for f in frameworks)
        fig, axes = plt.subplots(
            len(frameworks),
            1,
            figsize=(12, 1.2 + 1.3 * len(frameworks)),
            sharex=True,
            squeeze=False,
        )
        for ax, (label, ranks) in zip(axes[:, 0], frameworks.items(), strict=True):
            t = ranks[rank]
            for y, lane in enumerate(LANES):
                bars = [(a, b - a) for a, b in t["lanes"][lane]]
                ax.broken_barh(bars, (len(LANES) - 1 - y - 0.4, 0.8), color=colors[lane])
            ax.set_yticks(range(len(LANES)), list(reversed(LANES)), fontsize=8)
            ax.set_xlim(0, span)
            ax.set_title(
                f"{label}: {t['duration_ms']:.0f} ms, "
                f"{100 * t['comm_overlapped']:.0f}% of the transfers under compute",
                fontsize=9,
                loc="left",
            )
        axes[-1, 0].set_xlabel(f"ms since the step started (rank {rank}; the same scale for both)")
        fig.tight_layout()
        path = folder / f"timeline_rank{rank}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_scale(res: dict[str, Any], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    models = dict.fromkeys(row["model"] for row in res["memory"])
    for i, model in enumerate(models):
        rows = [row for row in res["memory"] if row["model"] == model]
        ws = [row["world"] for row in rows]
        color = f"C{i}"
        ax.plot(
            ws,
            [row["per_rank_gib"] for row in rows],
            "o",
            color=color,
            label=f"{model}: shard + window",
        )
        ax.plot(ws, [row["formula_gib"] for row in rows], "--", color=color, alpha=0.6)
        ax.axhline(rows[0]["window_gib"], color=color, lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size")
    ax.set_ylabel("parameter GiB per rank")
    ax.set_title("per-rank parameters: measured (o), P/W + window (--), window (..)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "scale_memory.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    timing = res["timing"]
    xs = [t["parameters"] / 1e9 for t in timing]
    for i, (key, label) in enumerate((("plan_ms", "fs.plan"), ("shard_ms", "fs.shard (meta)"))):
        ys = [t[key] for t in timing]
        a, b, r2 = scale.linear_fit(xs, ys)
        ax.plot(xs, ys, "o", color=f"C{i}", label=f"{label} (linear fit R^2={r2:.3f})")
        ax.plot(xs, [a * x + b for x in xs], "-", color=f"C{i}", lw=0.8)
    ax.set_xlabel("parameters (billions; Llama-7B shape, growing depth)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "scale_time.png", dpi=110)
    plt.close(fig)


def _start_up(res: dict[str, Any]) -> str:
    if "compiler_start_up_s" not in res:  # results from before it was measured
        return ""
    out = (
        f"First calls are compiled in a process whose compiler was started before the variants "
        f"(that start-up: {res['compiler_start_up_s']:.1f} s, counted in no variant)."
    )
    f = res.get("floor", {})
    if "first_call_s" in f:
        out += (
            f" For scale, {f['label']} (the unsharded model, every block in one graph; compile "
            f"time only, measured first): first call {f['first_call_s']:.1f} s."
        )
    return out


def compile_section(results: dict[str, Any]) -> str:
    r = next((v for k, v in sorted(results.items()) if k.startswith("compile-")), None)
    if r is None:
        return ""
    res, rows = r["result"], []
    for label, v in res["rows"].items():
        if "error" in v:
            rows.append([label, f"failed: `{v['error']}`", *["-"] * 8])
            continue
        counted = "graphs" in v
        rows.append(
            [
                label,
                *time_and_peak(v),
                f"{v['first_call_s']:.1f}" if counted else f"({v['first_call_s']:.1f})",
                v["graphs"] if counted else "-",
                v["recompiles"] if counted else "-",
                f"{v['loss_gap']:.1e}",
            ]
        )
    return "\n\n".join(
        [
            f"{res['workload']['description']} ({res['workload']['parameters'] / 1e6:.1f}M "
            f"parameters), {res['param_dtype']}, backend `{res['backend']}`; step times are "
            f"medians of {r['rounds']} steps after {r['warmup']} warm-up steps, peaks the median "
            f"of {res['memory_steps']} accounted steps; ratios to {res['baseline']} (eager). "
            + _start_up(res),
            table(
                [
                    "variant",
                    "step ms",
                    f"x {res['baseline']}",
                    "peak MiB per rank",
                    f"x {res['baseline']}",
                    "own thread MiB",
                    "first call s (compile)",
                    "graphs",
                    "recompiles",
                    "loss gap",
                ],
                rows,
            ),
            measured(r) + "\n",
        ]
    )


def summary_section(results: dict[str, Any]) -> str:
    """The suite's targets against the headline numbers (reported, never asserted)."""
    rows = []
    steps = [
        (r["world"], row)
        for k, r in sorted(results.items())
        if k.startswith("step-")
        for row in r["result"]["rows"]
        if row["variant"] == "funcshard"
    ]
    if steps:
        ratios = [row["ratio"] for _, row in steps]
        rows.append(
            [
                "training step time",
                "<= 0.9x FSDP2",
                f"{min(ratios):.2f}x - {max(ratios):.2f}x ({len(ratios)} configurations)",
                mark(max(ratios) <= 0.9),
            ]
        )
    memory = next((v for k, v in sorted(results.items()) if k.startswith("memory-")), None)
    if memory:
        for t in memory["result"]["tables"]:
            base, ours = t["rows"]["FSDP2"], t["rows"]["funcshard"]
            ratio = ours["peak_all"] / base["peak_all"]
            measured = f"{ratio:.2f}x (own thread {ours['peak_own'] / base['peak_own']:.2f}x)"
            for label, row in t["rows"].items():
                if label.startswith("funcshard, "):
                    measured += f"; {label[11:]}: {row['peak_all'] / base['peak_all']:.2f}x"
            rows.append(
                [
                    f"peak memory, {t['workload']['name']} {t['param_dtype']}",
                    "<= 0.95x FSDP2",
                    measured,
                    mark(ratio <= 0.95),
                ]
            )
    comms = [
        row["funcshard"]["x_bound"]
        for k, r in sorted(results.items())
        if k.startswith("comms-")
        for row in r["result"]["rows"]
        if row["funcshard"]["x_bound"] is not None
    ]
    if comms:
        rows.append(
            [
                "communication",
                "1.00x the lower bound",
                f"{min(comms):.3f}x - {max(comms):.3f}x",
                mark(max(comms) <= 1.0 + 1e-3),
            ]
        )
    for key, where in (("overhead-2ranks", "gloo"), ("overhead-fake", "fake process group")):
        if key in results:
            for t in results[key]["result"]["tables"]:
                ratio = t["rows"]["funcshard"]["ratio"]
                best = min(v["ratio"] for label, v in t["rows"].items() if "merge_groups" in label)
                rows.append(
                    [
                        f"overhead, {t['workload']['name']} ({where})",
                        "<= 1.0x FSDP2",
                        f"{ratio:.2f}x; merged: {best:.2f}x",
                        mark(ratio <= 1.0),
                    ]
                )
    compiled = next((v for k, v in sorted(results.items()) if k.startswith("compile-")), None)
    if compiled:
        c = compiled["result"]["rows"]
        ours, theirs = c.get("funcshard, whole step compiled", {}), c.get(_FSDP2_COMPILED, {})
        if "ratio" in ours:
            other = f"{theirs['ratio']:.2f}x" if "ratio" in theirs else "failed"
            rows.append(
                [
                    "step time, compiled (whole step)",
                    "<= FSDP2 + torch.compile",
                    f"{ours['ratio']:.2f}x FSDP2 eager (FSDP2 + torch.compile: {other}); "
                    f"peak {ours['peak_ratio']:.2f}x",
                    mark("ratio" not in theirs or ours["ratio"] <= theirs["ratio"]),
                ]
            )
    rows += recompute.summary_rows(results)
    rows += gpu.summary_rows(results)
    rows += gpu_8b_report.summary_rows(results)
    if not rows:
        return ""
    return table(["", "target", "measured (funcshard / FSDP2)", "met"], rows) + "\n"


_FSDP2_COMPILED = "FSDP2 + torch.compile(model)"


def sections(results: dict[str, Any], folder: Path, images: str) -> dict[str, str]:
    return {
        "summary": summary_section(results),
        "step": step_section(results),
        "memory": memory_section(results),
        "comms": comms_section(results),
        "overhead": overhead_section(results),
        "merged-plans": merged_plans_section(results),
        "scale": scale_section(results, folder, images),
        "explain_scale": explain_scale.section(results),
        "timeline": timeline_section(results, folder, images),
        "compile": compile_section(results),
        "recompute": recompute.section(results),
        "gpu": gpu.section(results),
        "gpu_8b": gpu_8b_report.section(results),
        "main_job": main_job.section(results),
        "explain": explain_accuracy.section(results),
    }


def fill(text: str, generated: dict[str, str]) -> str:
    """``text`` with each ``<!-- bench:NAME -->...<!-- /bench:NAME -->`` block replaced."""
    for name, body in generated.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
        text = pattern.sub(lambda m, body=body: m.group(1) + body.strip() + "\n" + m.group(2), text)
    return text


def main(folder: Path = harness.RESULTS, repository: bool = True) -> None:
    results = _load(folder)
    if repository:
        target = ROOT / "BENCHMARKS.md"
        generated = sections(results, folder, folder.relative_to(ROOT).as_posix())
        target.write_text(fill(target.read_text(), generated))
    else:
        target = folder / "BENCHMARKS.md"
        generated = sections(results, folder, ".")
        target.write_text("\n\n".join(f"## {k}\n\n{v}" for k, v in generated.items() if v))
    print(f"[bench] report: {target}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else harness.RESULTS)
