"""The picture of an :class:`~funcshard.Explanation`: memory over the step, with the collectives.

Top: bytes alive on this rank over the predicted step, stacked by category (each plan step's
most, drawn over the time the compute lane spends in it), the peak marked with its plan step.
Below: one lane per kind of collective, a bar per collective from its start to its end on the
communication lane. matplotlib is imported here only (``pip install matplotlib``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._explain import Explanation

_COLORS = {
    "parameters": "tab:blue",
    "optimizer state": "tab:purple",
    "gathered parameters": "tab:green",
    "gradients": "tab:orange",
    "activations": "tab:red",
    "temporaries": "tab:gray",
    "inputs": "tab:olive",
}
_LANES = ("all_gather", "reduce_scatter", "all_reduce")


def plot(e: Explanation, path: str) -> None:
    """Write the picture of ``e`` to ``path`` (PNG).

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "Explanation.plot needs matplotlib: pip install matplotlib (or funcshard[bench])."
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, lanes) = plt.subplots(
        2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    scale = 1e3  # ms
    edges, stacks = [], {c: [] for c in _COLORS}
    for m in e.timeline:
        start, end = m.start_s * scale, max(m.end_s, m.start_s) * scale
        edges += [start, end]
        for c in _COLORS:
            stacks[c] += [m.by_category.get(c, 0) / 2**20] * 2
    mem.stackplot(edges, *stacks.values(), labels=list(stacks), colors=list(_COLORS.values()))
    peak = e.peak_at
    mem.axvline(peak.start_s * scale, color="black", linestyle=":", linewidth=1)
    mem.annotate(
        f"peak {e.peak_bytes / 2**20:.1f} MiB: {peak.phase} {peak.step.op} "
        f"{peak.step.group or '<root>'}",
        (peak.start_s * scale, e.peak_bytes / 2**20),
        fontsize=8,
        xytext=(5, -12),
        textcoords="offset points",
    )
    mem.set_ylabel("MiB alive on this rank")
    mem.legend(fontsize=7, loc="upper left", ncols=4)
    mem.set_title(
        f"fs.explain: rank {e.rank} of {e.world}, predicted step "
        f"{e.predicted_step_s * 1e3:.2f} ms ({e.hardware.name}), "
        f"{e.exposed_communication_s * 1e3:.2f} ms of communication exposed",
        fontsize=9,
        loc="left",
    )
    for y, lane in enumerate(_LANES):
        bars = [(a * scale, (b - a) * scale) for kind, _, a, b in e.transfers if kind == lane]
        lanes.broken_barh(bars, (len(_LANES) - 1 - y - 0.4, 0.8), color=f"C{y + 2}")
    lanes.set_yticks(range(len(_LANES)), list(reversed(_LANES)), fontsize=8)
    lanes.set_xlabel("ms since the step started (predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
