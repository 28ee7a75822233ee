"""Optimizers as pure transformations over sharded trees, in the style of optax.

``opt = fs.optim.adamw(lr, weight_decay=0.1)``; ``state = opt.init(params)``;
``updates, state = opt.update(grads, state, params)``;
``params = fs.optim.apply_updates(params, updates)`` -- or, in place with torch.optim's memory,
``params, state = fs.optim.step(opt, params, grads, state)``. The arithmetic is torch.optim's own
kernels on the local shards; states are trees of DTensors placed like the parameters.
"""

from ._base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    chain,
    set_grads,
    step,
)
from ._clip import ClipState, clip_by_global_norm, global_norm
from ._finite import ApplyIfFiniteState, all_finite, apply_if_finite
from ._kernels import AdamState, SgdState, adam, adamw, add_decayed_weights, sgd
from ._masked import MaskedState, at_least_2d, masked
from ._schedules import (
    constant_schedule,
    cosine_decay_schedule,
    linear_schedule,
    warmup_cosine_decay_schedule,
)

__all__ = [
    "AdamState",
    "ApplyIfFiniteState",
    "ClipState",
    "EmptyState",
    "GradientTransformation",
    "MaskedState",
    "SgdState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_if_finite",
    "apply_updates",
    "at_least_2d",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "global_norm",
    "linear_schedule",
    "masked",
    "set_grads",
    "sgd",
    "step",
    "warmup_cosine_decay_schedule",
]
