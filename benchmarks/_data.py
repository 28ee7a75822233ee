"""Synthetic token batches for the benchmarks: timing needs tokens of any vocabulary size, not
text."""

from __future__ import annotations

import torch


def batch(step: int, rank: int, size: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences of a fixed affine recurrence with a random start: learnable, never repeated."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    steps = torch.arange(length)
    return (start * 7**steps + 3 * (7**steps - 1) // 6) % vocab
