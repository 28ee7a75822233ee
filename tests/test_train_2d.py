"""examples/train_2d.py, the torchtitan-style FSDP x TP recipe: it learns, and the 2-D layout
trains the same as plain FSDP on the same global batches."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLE))
import train_2d  # noqa: E402

ARGS = ["--steps", "12", "--width", "16", "--heads", "2", "--context", "8"]


def test_2d_learns_and_matches_plain_fsdp(world4):
    two_d = world4.run(train_2d.main, [*ARGS, "--dp", "2", "--tp", "2"])
    one_d = world4.run(train_2d.main, [*ARGS, "--dp", "4", "--tp", "1"])
    assert all(r == two_d[0] for r in two_d)  # every rank reports the same losses
    losses = two_d[0]
    assert losses[-1] < 0.7 * losses[0], losses
    # the same model, data and optimizer: TP changes the order of float sums only
    assert max(abs(a - b) for a, b in zip(losses, one_d[0], strict=True)) < 1e-4
