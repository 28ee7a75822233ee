"""The largest batch whose predicted step fits a memory budget, from a few ``explain`` runs.

[Note: searching the batch along a line]
A step's peak is the most bytes alive at any moment; each moment's bytes are a constant
(parameters, optimizer state, gathered groups) plus what grows with the batch (activations,
temporaries, inputs), so the peak is close to ``a + b * batch`` -- exactly so when the same
moment stays the peak. Two runs (batch 1 and 2) give the line; where it crosses the budget is
the guess, and runs at the guess and one past it confirm it. When the line is off (the peak
moves to another moment: a max of lines is convex, so the chord between a fitting and a
failing batch crosses the budget early), the next guess is the chord between the largest batch
known to fit and the smallest known not to; after a few chords the search bisects, so it ends.
Runs are ``O(1)`` when the peak is linear and ``O(log batch)`` at worst.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

_CHORDS = 4  # chord guesses before bisection takes over


def largest_batch(
    make_explanation: Callable[[int], Any],
    budget: float,
    *,
    limit: int = 1 << 20,
) -> int:
    """The largest batch ``b >= 1`` whose ``make_explanation(b).peak_bytes <= budget``.

    ``make_explanation``: builds the step's prediction for a batch (an
    :class:`~funcshard.Explanation`, or anything with ``peak_bytes``); called a few times
    (see [Note: searching the batch along a line]), never twice for one batch. ``budget``: bytes
    per rank. ``limit``: the largest batch tried (returned when it still fits: the peak does not
    grow with the batch).

    Returns the batch; ``0`` when batch 1 does not fit.
    Assumes a peak that does not shrink as the batch grows.

    Raises:
        ValueError: ``budget`` not positive or ``limit`` below 1.
    """
    if not budget > 0 or limit < 1:
        raise ValueError(f"largest_batch: budget must be > 0 and limit >= 1; got {budget}, {limit}")
    peaks: dict[int, int] = {}

    def peak(b: int) -> int:
        if b not in peaks:
            peaks[b] = int(make_explanation(b).peak_bytes)
        return peaks[b]

    if peak(1) > budget:
        return 0
    lo, hi = 1, None  # lo fits; hi (None: not found yet) does not
    probe = min(2, limit)
    chords = 0
    while lo < limit and (hi is None or hi - lo > 1):
        if probe != lo:
            if peak(probe) <= budget:
                lo = probe
            else:
                hi = probe
            if lo >= limit or (hi is not None and hi - lo <= 1):
                break
        probe, chords = _next_probe(peaks, budget, lo, hi, limit, chords)
    return lo


def _next_probe(
    peaks: dict[int, int], budget: float, lo: int, hi: int | None, limit: int, chords: int
) -> tuple[int, int]:
    """The next batch to try, strictly between ``lo`` and ``hi`` (or above ``lo``)."""
    top = limit if hi is None else hi - 1
    if hi is not None and chords >= _CHORDS:
        return (lo + hi) // 2, chords
    if hi is not None:
        x0, x1 = lo, hi
    else:  # the line through the two largest batches that fit
        x0, x1 = sorted(b for b in peaks if b <= lo)[-2:] if len(peaks) > 1 else (lo, lo)
    slope = (peaks[x1] - peaks[x0]) / (x1 - x0) if x1 != x0 else 0.0
    if slope <= 0:  # the peak does not grow: double
        return min(max(2 * lo, lo + 1), top), chords
    guess = x0 + math.floor((budget - peaks[x0]) / slope)
    # at the guess when it is new; one past lo when the line says lo is the answer (confirm)
    return min(max(guess, lo + 1), top), chords + (hi is not None)


def parse_bytes(text: str) -> float:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30 (also kB/KiB, MB/MiB, TB/TiB, or bytes).

    Raises:
        ValueError: not a number with one of these units.
    """
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().replace(" ", "")
    number = s.rstrip("bBkKmMgGtTiI")
    unit = s[len(number) :].upper()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(
            f"budget {text!r}: expected a positive number of bytes with a unit, e.g. 80GB "
            "(10^9 bytes) or 80GiB (2^30 bytes)."
        )
    return value * units[unit]
