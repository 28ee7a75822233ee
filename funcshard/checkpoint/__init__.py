"""Checkpoints of sharded training state, built on ``torch.distributed.checkpoint``.

``save`` / ``async_save`` / ``load`` any pytree of DTensors, tensors, Python scalars and
``RNGState`` leaves (resharding on load: other world sizes, meshes and placements); ``latest``
finds the newest committed checkpoint; ``rng_state`` / ``set_rng_state`` capture and restore
every generator of a rank; ``export_state_dict`` / ``import_state_dict`` convert to and from a
plain full ``state_dict`` (or a safetensors / torch file).
"""

from ._export import export_state_dict, import_state_dict
from ._load import load
from ._rng import RNGState, rng_state, set_rng_state
from ._save import Saving, async_save, latest, save

__all__ = [
    "RNGState",
    "Saving",
    "async_save",
    "export_state_dict",
    "import_state_dict",
    "latest",
    "load",
    "rng_state",
    "save",
    "set_rng_state",
]
