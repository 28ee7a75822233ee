"""Every random number generator of this process as data: ``rng_state`` / ``set_rng_state``.

[Note: RNG states are per rank]
Each rank draws its own dropout masks and data, so a rank's generator states are its own. The
checkpoint stores an :class:`RNGState` leaf once per rank, under ``<key>.rank<r>.<generator>``
(DCP keeps one copy of a plain tensor that every rank saves under the same key, so per-rank values
need per-rank keys). Loading on the same world size gives every rank back its own states. On more
ranks, rank ``r >= W`` (``W`` the saved world size) gets states *derived* from saved rank
``r % W`` and ``r`` (a hash of both seeds fresh generators): deterministic and distinct per rank,
but not a continuation of any saved stream. On fewer ranks, the states of ranks ``>= world`` are
not loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import random
import struct

import torch

_PY = struct.Struct("<625Id")  # Mersenne Twister words + position, gauss_next (nan: None)
_NP = struct.Struct("<iid")  # position, has_gauss, cached_gaussian (after 624 uint32 words)


@dataclasses.dataclass(frozen=True)
class RNGState:
    """The generator states of one process, as ``uint8`` tensors.

    ``torch``: the CPU generator (``torch.get_rng_state()``); ``cuda``: one state per CUDA
    device (empty without CUDA); ``python``: the ``random`` module; ``numpy``: numpy's global
    ``RandomState`` (``None`` where numpy is not installed). A leaf of funcshard's trees; saved
    per rank by :func:`~funcshard.checkpoint.save` (see [Note: RNG states are per rank]).
    """

    torch: torch.Tensor
    cuda: tuple[torch.Tensor, ...]
    python: torch.Tensor
    numpy: torch.Tensor | None

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{generator name: state}``, e.g. ``{"torch": ..., "cuda.0": ..., "python": ...}``."""
        out = {"torch": self.torch, "python": self.python}
        out.update({f"cuda.{i}": s for i, s in enumerate(self.cuda)})
        if self.numpy is not None:
            out["numpy"] = self.numpy
        return out

    @staticmethod
    def from_tensors(states: dict[str, torch.Tensor]) -> RNGState:
        cuda = tuple(states[f"cuda.{i}"] for i in range(sum(k[:5] == "cuda." for k in states)))
        return RNGState(states["torch"], cuda, states["python"], states.get("numpy"))


def rng_state() -> RNGState:
    """This process's generator states (copies): torch CPU, every CUDA device, ``random``, numpy.

    Put it in the tree you save (``{"rng": fs.checkpoint.rng_state(), ...}``); after loading,
    :func:`set_rng_state` makes every generator continue exactly where it was saved.
    """
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
    np_state = None
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        _, words, pos, has_gauss, cached = np.random.get_state(legacy=True)
        np_state = _bytes(words.astype("<u4").tobytes() + _NP.pack(pos, has_gauss, cached))
    _, words, gauss = random.getstate()
    py_state = _bytes(_PY.pack(*words, math.nan if gauss is None else gauss))
    return RNGState(torch.get_rng_state(), cuda, py_state, np_state)


def set_rng_state(state: RNGState) -> None:
    """Restore the generators from ``state`` (from :func:`rng_state`, or loaded).

    Raises:
        TypeError: ``state`` is not an :class:`RNGState`.
        ValueError: it holds CUDA states for another number of devices than this process has.
    """
    if not isinstance(state, RNGState):
        raise TypeError(
            f"set_rng_state: expected an fs.checkpoint.RNGState (from fs.checkpoint.rng_state() "
            f"or a loaded checkpoint), got {type(state).__name__}."
        )
    torch.set_rng_state(state.torch)
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(state.cuda) != devices:
        raise ValueError(
            f"set_rng_state: the state has {len(state.cuda)} CUDA generator states, this process "
            f"has {devices} CUDA devices; restore on the same kind of machine."
        )
    if state.cuda:
        torch.cuda.set_rng_state_all(list(state.cuda))
    *words, gauss = _PY.unpack(state.python.numpy().tobytes())
    random.setstate((3, tuple(words), None if math.isnan(gauss) else gauss))
    if state.numpy is not None:
        import numpy as np

        raw = state.numpy.numpy().tobytes()
        words = np.frombuffer(raw[: 624 * 4], dtype="<u4").astype(np.uint32)
        np.random.set_state(("MT19937", words, *_NP.unpack(raw[624 * 4 :])))


def derive(state: RNGState, rank: int) -> RNGState:
    """Fresh states for ``rank`` seeded from ``state`` (another rank's) and ``rank``.

    See [Note: RNG states are per rank].
    """
    digest = hashlib.sha256(state.torch.numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1
    cuda = tuple(
        torch.Generator(f"cuda:{i}").manual_seed(seed).get_state() for i in range(len(state.cuda))
    )
    words = random.Random(seed).getstate()[1]
    py_state = _bytes(_PY.pack(*words, math.nan))
    np_state = None
    if state.numpy is not None:
        import numpy as np

        _, np_words, pos, has_gauss, cached = np.random.RandomState(seed % 2**32).get_state()
        np_state = _bytes(np_words.astype("<u4").tobytes() + _NP.pack(pos, has_gauss, cached))
    return RNGState(torch.Generator().manual_seed(seed).get_state(), cuda, py_state, np_state)


def _bytes(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
