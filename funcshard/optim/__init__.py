"""Optimizers as pure transformations over sharded trees, in the style of optax.

``opt = fs.optim.adamw(lr, weight_decay=0.1)``; ``state = opt.init(params)``;
``updates, state = opt.update(grads, state, params)``;
``params = fs.optim.apply_updates(params, updates)`` -- or, in place with torch.optim's memory,
``params, state = fs.optim.step(opt, params, grads, state)``. The arithmetic is torch.optim's own
kernels on the local shards; states are trees of DTensors placed like the parameters.
"""

from ._adam_sgd import AdamState, SgdState, adam, adamw, add_decayed_weights, sgd
from ._base import EmptyState, GradientTransformation, apply_updates, chain, set_grads, step
from ._clip import ClipState, clip_by_global_norm, global_norm
from ._ema import Ema, EmaState, ema
from ._finite import ApplyIfFiniteState, all_finite, apply_if_finite
from ._layout import shard_state, state_placements
from ._masked import MaskedState, at_least_2d, masked
from ._muon import MuonState, muon
from ._offload import OffloadState, offload
from ._partition import PartitionState, hidden_matrices, muon_adamw, partition
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
    "Ema",
    "EmaState",
    "EmptyState",
    "GradientTransformation",
    "MaskedState",
    "MuonState",
    "OffloadState",
    "PartitionState",
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
    "ema",
    "global_norm",
    "hidden_matrices",
    "linear_schedule",
    "masked",
    "muon",
    "muon_adamw",
    "offload",
    "partition",
    "set_grads",
    "sgd",
    "shard_state",
    "state_placements",
    "step",
    "warmup_cosine_decay_schedule",
]
