"""Ranks that average over different counts: ``grad_reduce="weighted"``, and empty batches.

[Note: ranks that average over different counts]
``grad_reduce="mean"`` gives each rank's loss the weight ``1/W``: the gradient of the global-batch
mean only if every rank averages over as many samples (or tokens). A rank with an *empty* batch
is the silent extreme: its mean loss is NaN (a mean over nothing), its gradient zero, and every
rank's averaged gradient the others' scaled by ``(W - k) / W``. So every ``unshard`` /
``schedule`` / ``reduce`` call publishes this rank's *count* in the status it exchanges anyway
(see [Note: one status per call] in ``_consensus``; a few bytes more, no collective), and:

- ``"mean"``: a rank whose count is 0 is an error on every rank, before any collective of the
  call, naming the rank(s) and the fixes. The count is the ``count=`` given, else 0 when a
  tensor of the batch has a leading dim of 0, else the leading dim of the batch's first tensor
  (the arguments of a scheduled ``apply`` and of the enclosing
  :func:`~funcshard.value_and_grad`), else unknown (nothing is checked). Ranks whose counts
  differ get a warning (once per process) pointing to ``"weighted"``: their samples weigh
  differently. Counts are only published when the call computes gradients (grad mode on, a leaf
  that requires grad), so a forward without gradients on an empty batch is fine.
- ``"weighted"``: each rank's reductions are weighted by ``n_r / N`` instead of ``1/W``, ``N``
  the sum of the counts of the ranks the gradient is reduced over (the leaf's data-parallel
  mesh): the gradient of the mean over all ranks' samples, as the unsharded model on the global
  batch gives it. The weight is applied once, to this rank's own contribution, before the
  first reduction (the others sum); a rank of count 0 contributes exactly zero (even where its
  mean loss's gradient is NaN). Every rank must give ``count=``.
- ``"sum"``: no count (``count=`` is refused: it would change nothing).

Under ``torch.compile`` the exchange runs once, while tracing: ``"weighted"``, whose weights
change every call, is refused there; ``"mean"`` checks the traced call only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._runtime._compile import compiling
from .._trees._spec import LocalShard
from . import _consensus
from ._updates import by_rank

MODES = ("mean", "sum", "weighted")
Count = float | None  # a count as published: None is "unknown" (not checked, not weighted)

_WARNED: set[str] = set()  # warnings given once per process (see _warn_uneven)
# the count inferred from the arguments of the innermost fs.value_and_grad call
_BATCH: contextvars.ContextVar[Count] = contextvars.ContextVar("funcshard_batch", default=None)


def reduction(op: str, name: str = "grad_reduce") -> str:
    """``op`` checked: one of :data:`MODES`."""
    if op not in MODES:
        raise ValueError(f"{name} must be 'mean', 'sum' or 'weighted', got {op!r}.")
    return op


def empty(tree: Any) -> Count:
    """0.0 if a plain tensor of ``tree`` has a leading dim of 0 (an empty batch), else the
    leading dim of its first plain tensor (its batch size, as far as it can be told; not under
    ``torch.compile``, where reading it would specialise a dynamic batch size), else None."""
    first = None
    for x in optree.tree_leaves(tree):
        plain = isinstance(x, torch.Tensor) and not isinstance(x, DTensor | LocalShard)
        if plain and x.dim() >= 1:
            if x.shape[0] == 0:
                return 0.0
            if first is None and not compiling():
                first = float(x.shape[0])
    return first


@contextlib.contextmanager
def batch(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[None]:
    """While ``fs.value_and_grad`` runs ``fn``: the count its (non-differentiated) arguments
    imply, for the ``unshard`` / ``schedule`` calls inside (see [Note: ranks that average ...])."""
    token = _BATCH.set(empty((args, kwargs)))
    try:
        yield
    finally:
        _BATCH.reset(token)


def own(fn: str, op: str, count: Any, inputs: Any = None) -> Count:
    """This rank's count for a call of ``fn`` reducing with ``op``: ``count`` checked, or (for
    ``"mean"``) inferred from ``inputs`` and the enclosing ``value_and_grad``.

    Raises:
        ValueError: ``count`` missing for ``"weighted"``, given for ``"sum"``, or not a finite
            number >= 0.
        NotImplementedError: ``"weighted"`` under ``torch.compile``.
    """
    if op == "sum":
        if count is not None:
            raise ValueError(
                f"{fn}: count={count!r} with grad_reduce='sum': a sum weights no rank, so the "
                "count would change nothing. Use grad_reduce='weighted' to weight each rank by "
                "its count, or drop count."
            )
        return None
    if op == "weighted" and compiling():
        raise NotImplementedError(
            f"{fn}: grad_reduce='weighted' under torch.compile: the weights change every call, "
            "and funcshard's per-call exchange runs only while tracing. Use "
            "grad_reduce='sum' with a loss summed over the local samples and divided by the "
            "all-reduced global count."
        )
    if count is None:
        if op == "weighted":
            raise ValueError(
                f"{fn}: grad_reduce='weighted' needs this rank's count: pass count=<the number "
                "of samples (or tokens) its loss averages over>, e.g. count=len(batch) or "
                "count=int((labels != -100).sum())."
            )
        found = empty(inputs)
        return found if found is not None else _BATCH.get()
    return _number(fn, count)


def _computes_gradients(shards: Sequence[torch.Tensor]) -> bool:
    """Whether a call computes gradients of ``shards`` (grad mode on, one requires grad): a
    forward without gradients reduces nothing, so its count is not checked."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in shards)


def _with_grad_mode(agreement: tuple, grads: bool) -> tuple:
    """``agreement`` (``(leaves, options[, error, digest])``) with ``grads`` among the options
    (see [Note: ranks that differ in grad mode])."""
    leaves, options, *rest = agreement
    if len(rest) == 2 and rest[1] is not None:  # a digest kept by the caller: one bit flips
        rest = [rest[0], rest[1] ^ int(grads)]
    return (leaves, (*options, ("computes gradients", grads)), *rest)


def _number(fn: str, count: Any) -> float:
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.is_complex() or count.dtype == torch.bool:
            raise ValueError(f"{fn}: count must be a number, got a tensor of shape "
                             f"{list(count.shape)} and dtype {count.dtype}.")  # fmt: skip
        count = count.item()  # a CUDA tensor: one host sync
    ok = isinstance(count, int | float) and not isinstance(count, bool)
    if not ok or not math.isfinite(count) or count < 0:
        raise ValueError(
            f"{fn}: count must be a finite number >= 0 (this rank's number of samples or "
            f"tokens), got {count!r}."
        )
    return float(count)


def agree(fn: str, op: str, count: Count, shards, *agreement) -> list[Count]:
    """:func:`._consensus.agree` (``agreement``: its arguments) with this rank's ``count``
    -- published when the call differentiates ``shards`` (always if ``None``: the
    call's own reduction) -- and the ranks' counts checked for ``op``; returns them.

    [Note: ranks that differ in grad mode]
    A call that differentiates its ``shards`` (grad mode on, a leaf that requires grad) issues
    its reductions in the backward; one that does not, none. So whether it does is one of the
    options the ranks must agree on: a forward under ``torch.no_grad()`` on some ranks only
    (inside a loss, say) is an error on every rank, naming ``<computes gradients>``, before
    any collective -- instead of the other ranks waiting in their backward's reductions. It
    rides the status the call exchanges anyway: ``agreement``'s options and its digest, if
    given, are extended here."""
    if shards is not None:
        grads = _computes_gradients(shards)
        count = count if grads else None
        agreement = _with_grad_mode(agreement, grads)
    counts = _consensus.agree(fn, *agreement, count=count)
    check(fn, op, counts)
    return counts


def check(fn: str, op: str, counts: Sequence[Count]) -> None:
    """Raise the same error on every rank if the ranks' ``counts`` (everyone's, from the
    exchange) do not fit ``op`` (see [Note: ranks that average over different counts])."""
    error = _error(fn, op, counts)
    if error is not None:
        error._funcshard_agreed = True  # type: ignore[attr-defined]  # every rank raises it
        raise error
    _warn_uneven(fn, op, counts)


def _warn_uneven(fn: str, op: str, counts: Sequence[Count]) -> None:
    """Warn (once per process) when ranks average over different counts under ``"mean"``."""
    known = [c for c in counts if c is not None]
    if op != "mean" or len(set(known)) < 2 or "mean" in _WARNED:
        return
    _WARNED.add("mean")
    seen = by_rank(["unknown" if c is None else f"{c:g}" for c in counts])
    warnings.warn(
        f"{fn}: grad_reduce='mean' over batches of different sizes ({seen}): each rank's mean "
        f"loss gets the weight 1/{len(counts)}, so the gradient is the mean of the ranks' "
        "means, not the mean over the global batch (a sample of a smaller batch weighs more). "
        "Use grad_reduce='weighted' with count=<samples or tokens> for the global-batch mean, "
        "or equal batches (drop_last=True). Warned once per process (docs/failures.md).",
        UserWarning,
        stacklevel=4,
    )


def _error(fn: str, op: str, counts: Sequence[Count]) -> Exception | None:
    if op == "mean":
        zero = [r for r, c in enumerate(counts) if c == 0]
        if not zero:
            return None
        world = len(counts)
        return ValueError(
            f"{fn}: rank(s) {zero} have an empty batch (count 0) while grad_reduce='mean': "
            "their mean loss is NaN (a mean over nothing) and their gradient zero, so every "
            f"rank's gradient would silently be the others' times {world - len(zero)}/{world}. "
            "Give every rank samples (equal batches: drop_last=True), or weight each rank by "
            "its count: grad_reduce='weighted' with count=<samples or tokens>. If the loss "
            "already divides by a global count, use grad_reduce='sum'; to override the "
            "inference (a leading dim of 0 in the batch), pass the count (docs/failures.md)."
        )
    if op != "weighted" or all(c is None for c in counts):  # no rank computes gradients
        return None
    missing = [r for r, c in enumerate(counts) if c is None]
    if missing:
        return ValueError(
            f"{fn}: grad_reduce='weighted', but rank(s) {missing} compute no gradient in this "
            "call (grad mode off, or no leaf that requires grad) while the others do: every "
            "rank must differentiate the same call."
        )
    if sum(counts) == 0:  # type: ignore[arg-type]
        return ValueError(
            f"{fn}: grad_reduce='weighted' and every rank's count is 0: there is no sample to "
            "average over. Skip the step when the global batch is empty."
        )
    return None


def weight(counts: Sequence[Count], mesh: DeviceMesh) -> float:
    """This rank's weight ``n_r / N`` over the ranks of ``mesh`` (``counts``: every rank's of
    the default group, indexed by global rank); 0.0 if their counts are all 0."""
    total = sum(counts[r] for r in _ranks(mesh))  # type: ignore[misc]
    mine = counts[dist.get_rank() if dist.is_initialized() else 0]
    return mine / total if total else 0.0  # type: ignore[operator]


@functools.lru_cache(maxsize=256)
def _ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh`` (a sub-mesh: those of this rank's slice)."""
    return tuple(mesh.mesh.flatten().tolist())


def refuse_experts(experts: Sequence[str]) -> None:
    """Raise for ``"weighted"`` over expert-parallel parameters ``experts`` (if any): each
    rank's gradient is scaled by its own count, but an expert's gradient already sums the
    losses of every expert-parallel rank whose tokens it computed, which no single scale per
    rank can weight."""
    if experts:
        raise ValueError(
            f"grad_reduce='weighted' is not supported for expert-parallel parameters "
            f"{list(experts)}: their gradients sum the losses of every expert-parallel rank, "
            "which one weight per rank cannot weight. Use grad_reduce='mean' with equal "
            "batches, or 'sum' with the loss divided by the global count."
        )
