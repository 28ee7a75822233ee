"""Learning-rate schedules: pure functions of the step count, with optax's definitions.

Each schedule is a small frozen dataclass (printable, comparable) called as ``schedule(step)``
with the number of updates done so far (``0`` for the first update); it returns a float.

[Note: schedules of a tensor count]
Under ``torch.compile`` the optimizer's step count is a traced tensor (see [Note: the step count
under torch.compile] in ``_adam_sgd``). Called with a tensor, a schedule computes with torch ops
only (``clamp``, ``cos``, ``where``; no Python branch on the count, no ``int()``), in float64,
and returns a 0-dim float64 tensor on the count's device: the graph reads the count at run time,
so one graph serves every step, as optax's schedules of a traced count serve ``jax.jit``. Both
branches of a piecewise schedule are computed and ``where`` picks one, as optax's
``join_schedules`` does. Called with an int, a schedule returns the float it always returned;
the two agree to float64 rounding (``math.cos`` and ``torch.cos`` may differ in the last bit).
"""

from __future__ import annotations

import dataclasses
import math

import torch


def _int(step) -> int:
    return int(step)


def _is_tensor(step) -> bool:
    return isinstance(step, torch.Tensor)


def _float64(step: torch.Tensor) -> torch.Tensor:
    """The count (one element) as a 0-dim float64 tensor."""
    return step.reshape(()).to(torch.float64)


def _full(step: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full((), float(value), dtype=torch.float64, device=step.device)


def _non_negative(fn: str, **values) -> None:
    for name, v in values.items():
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{fn}: {name}={v!r}; it must be a finite number >= 0.")


@dataclasses.dataclass(frozen=True)
class Constant:
    value: float

    def __call__(self, step) -> float | torch.Tensor:
        if _is_tensor(step):
            return _full(step, self.value)
        return float(self.value)


@dataclasses.dataclass(frozen=True)
class Linear:
    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __call__(self, step) -> float | torch.Tensor:
        if _is_tensor(step):
            if self.transition_steps == 0:
                return _full(step, self.init_value)
            since = (_float64(step) - self.transition_begin).clamp(min=0)
            frac = (since / self.transition_steps).clamp(max=1.0)
            return (1 - frac) * (self.init_value - self.end_value) + self.end_value
        if self.transition_steps == 0:
            return float(self.init_value)
        frac = min(max(_int(step) - self.transition_begin, 0) / self.transition_steps, 1.0)
        return (self.init_value - self.end_value) * (1 - frac) + self.end_value


@dataclasses.dataclass(frozen=True)
class CosineDecay:
    init_value: float
    decay_steps: int
    alpha: float = 0.0

    def __call__(self, step) -> float | torch.Tensor:
        if _is_tensor(step):
            t = _float64(step).clamp(max=self.decay_steps) / self.decay_steps
            cosine = 0.5 * (1 + torch.cos(math.pi * t))
            return self.init_value * ((1 - self.alpha) * cosine + self.alpha)
        t = min(_int(step), self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1 + math.cos(math.pi * t))
        return self.init_value * ((1 - self.alpha) * cosine + self.alpha)


@dataclasses.dataclass(frozen=True)
class WarmupCosineDecay:
    init_value: float
    peak_value: float
    warmup_steps: int
    decay_steps: int
    end_value: float = 0.0

    def __call__(self, step) -> float | torch.Tensor:
        warmup = Linear(self.init_value, self.peak_value, self.warmup_steps)
        alpha = 0.0 if self.peak_value == 0 else self.end_value / self.peak_value
        decay = CosineDecay(self.peak_value, self.decay_steps - self.warmup_steps, alpha)
        if _is_tensor(step):  # both pieces, then where (see [Note: schedules of a tensor count])
            step = _float64(step)
            return torch.where(
                step < self.warmup_steps, warmup(step), decay(step - self.warmup_steps)
            )
        step = _int(step)
        if step < self.warmup_steps:
            return warmup(step)
        return decay(step - self.warmup_steps)


def constant_schedule(value: float) -> Constant:
    """``value`` at every step."""
    _non_negative("constant_schedule", value=value)
    return Constant(float(value))


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Linear:
    """``init_value`` until ``transition_begin``, then linearly to ``end_value`` over
    ``transition_steps`` steps, then ``end_value`` (a linear warm-up from 0 to the peak:
    ``linear_schedule(0.0, peak, warmup_steps)``)."""
    _non_negative(
        "linear_schedule",
        init_value=init_value,
        end_value=end_value,
        transition_steps=transition_steps,
        transition_begin=transition_begin,
    )
    return Linear(float(init_value), float(end_value), int(transition_steps), int(transition_begin))


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> CosineDecay:
    """``init_value * ((1 - alpha) * (1 + cos(pi * t / decay_steps)) / 2 + alpha)`` for step
    ``t``, then ``init_value * alpha`` after ``decay_steps`` steps.

    Raises:
        ValueError: ``decay_steps`` is not positive, or a value is negative.
    """
    _non_negative("cosine_decay_schedule", init_value=init_value, alpha=alpha)
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule: decay_steps={decay_steps!r}; it must be > 0.")
    return CosineDecay(float(init_value), int(decay_steps), float(alpha))


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> WarmupCosineDecay:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine
    decay to ``end_value`` at step ``decay_steps`` (which counts the warm-up, as in optax),
    then ``end_value``.

    Raises:
        ValueError: ``decay_steps <= warmup_steps``, or a value is negative.
    """
    _non_negative(
        "warmup_cosine_decay_schedule",
        init_value=init_value,
        peak_value=peak_value,
        warmup_steps=warmup_steps,
        end_value=end_value,
    )
    if not decay_steps > warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: decay_steps={decay_steps!r} must be greater than "
            f"warmup_steps={warmup_steps!r} (decay_steps is the total length, warm-up included)."
        )
    return WarmupCosineDecay(
        float(init_value), float(peak_value), int(warmup_steps), int(decay_steps), float(end_value)
    )
