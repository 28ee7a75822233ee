"""What differs between the torch versions funcshard supports (2.11 to 2.13), in one place.

[Note: supported torch versions]
The eager paths run on torch 2.11, 2.12 and 2.13 (``pyproject.toml`` declares the range); CI
tests 2.13. Where a newer torch renamed an API, the newer name is used when present. Features
that need 2.13 check ``HAS_2_13`` and say so (``needs_2_13``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
HAS_2_13 = TORCH >= (2, 13)

# torch 2.13 renamed the in-place all-gather into one tensor (the old name warns there)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def needs_2_13(feature: str) -> str:
    """The error message for ``feature`` on a torch older than 2.13."""
    return (
        f"{feature} needs torch >= 2.13 (this is torch {torch.__version__}); the eager paths "
        "(shard, unshard, reduce, schedule, value_and_grad, optim, checkpoint) run on 2.11 and "
        "later. Upgrade torch, or run the step eagerly."
    )
