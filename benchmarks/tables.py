"""Markdown pieces shared by the generated sections of BENCHMARKS.md: tables, ratios and the
"measured on" line. ``report`` and the parts that write their own section (``gpu``,
``recompute``) import them from here."""

from __future__ import annotations

from typing import Any

from . import harness

MiB = 2**20


def measured(r: dict[str, Any]) -> str:
    m = r["machine"]
    load = f"load average {m['load_average'][0]:.1f} -> {r['load_average_after'][0]:.1f}"
    world = f"{r['world']} ranks, " if "world" in r else ""
    return f"*Measured on {harness.label(m)}, {world}{m['date'][:10]}, torch {m['torch']}, {load}.*"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(x: float | None) -> str:
    return "-" if x is None else f"**{x:.3f}**"


def mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def time_and_peak(v: dict[str, Any]) -> list[str]:
    """A row's step time, its ratio, the all-threads peak, its ratio and the own-thread peak."""
    return [
        f"{v['ms']:.0f}",
        f"**{v['ratio']:.2f}**",
        f"{v['peak_all'] / MiB:.1f}",
        f"**{v['peak_ratio']:.2f}**",
        f"{v['peak_own'] / MiB:.1f} ({v['peak_own_ratio']:.2f}x)",
    ]
