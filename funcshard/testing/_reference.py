"""Checks against full tensors: ``assert_close`` and ``reference_value_and_grad``.

Both run on the ranks, inside ``fn``, and are collective: every rank calls them with trees of
the same structure (they gather DTensors with ``full_tensor()``, leaf by leaf in tree order,
before comparing or computing anything, so a mismatch on one rank cannot leave the others
waiting in a gather).

[Note: what the reference computes]
``fs.value_and_grad`` returns, on each rank, the value of that rank's loss and gradients
averaged over ranks (``grad_reduce="mean"``): ``(1/W) sum_r grad L(params, batch_r)``. The
reference returns the same pair computed without sharding: the value of ``loss_fn`` on this
rank's batch, and the gradient of ``loss_fn`` on the *global* batch (the ranks' batches
concatenated along dim 0, in rank order), which is what one process training on the whole batch
computes. The two gradients are equal when the loss is a mean over samples that do not interact
(no BatchNorm in training mode) and every rank has the same number of samples ``n``:
``(1/(W n)) sum_r sum_i l_ri = (1/W) sum_r (1/n) sum_i l_ri``. With unequal batches, or
``grad_reduce="sum"``, they differ, by design: the reference is what the user meant, not what
funcshard did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._trees._spec import LocalShard, from_local
from .._trees._tree import PyTree, flatten, flatten_like, map_with_path, unflatten

_MAX_REPORTED = 10


def assert_close(
    actual: PyTree,
    expected: PyTree,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    **kwargs: Any,
) -> None:
    """``torch.testing.assert_close`` on every leaf of two trees, gathering sharded leaves.

    Collective: call it on every rank, with trees of the same structure (it gathers DTensors).

    Args:
        actual: a tree of DTensors (compared as their ``full_tensor()``), LocalShards (likewise),
            plain tensors (compared as they are: e.g. this rank's loss) or numbers.
        expected: a tree of the same structure: full tensors (or sharded ones, gathered too).
        rtol, atol, kwargs: passed to ``torch.testing.assert_close`` (defaults by dtype;
            ``check_dtype=False`` to compare across dtypes, ...).

    Raises:
        AssertionError: the structures differ (naming the key paths missing from either tree),
            or values differ (naming every differing key path, with torch's report).
    """
    try:
        leaves = flatten_like(actual, expected, what="actual", like_what="expected")
    except ValueError as e:
        raise AssertionError(f"assert_close: {e}") from None
    paths, expected_leaves, _ = flatten(expected)
    fulls = [_full(leaf) for leaf in leaves]
    expected_leaves = [_full(leaf) for leaf in expected_leaves]
    failures = []
    for path, a, e in zip(paths, fulls, expected_leaves, strict=True):
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, **kwargs)
        except AssertionError as err:
            failures.append(f"{path}: {err}")
    if failures:
        shown = "\n\n".join(failures[:_MAX_REPORTED])
        more = len(failures) - _MAX_REPORTED
        raise AssertionError(
            f"assert_close: {len(failures)} of {len(paths)} leaves differ"
            + (f" ({more} more not shown)" if more > 0 else "")
            + f":\n\n{shown}"
        )


def reference_value_and_grad(
    loss_fn: Callable[..., torch.Tensor],
    params: PyTree,
    *batch: Any,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, PyTree]:
    """What ``fs.value_and_grad(sharded_loss)(sharded, *batch)`` should return on this rank,
    computed without sharding, with plain autograd: ``(value, grads)``.

    ``loss_fn(full_params, *batch)`` is the unsharded loss (it calls the module with full
    tensors, e.g. through :func:`~funcshard.functional_call`; no funcshard transform). It is
    called twice: with gradients on the global batch (every rank's ``batch`` concatenated along
    dim 0, in rank order), and without on this rank's batch; it should be pure. See [Note: what
    the reference computes] for when the gradients equal funcshard's.

    Collective: call it on every rank (it gathers ``params`` and the batch). Without an
    initialised process group the batch is the global batch, and nothing is gathered.

    Args:
        loss_fn: returns a one-element tensor.
        params: a tree of DTensors or LocalShards (gathered) or full tensors (used as they are).
        batch: this rank's inputs: trees whose tensor leaves are concatenated over ranks
            (same trailing dims on every rank); other leaves are passed as they are.
        group: the ranks whose batches make the global batch (default: all).

    Returns:
        ``value``: ``loss_fn`` on this rank's batch, detached. ``grads``: plain full tensors with
        the structure of ``params``, the gradient of ``loss_fn`` on the global batch (zeros for
        parameters that do not influence it; ``None`` for integer leaves, as
        ``fs.value_and_grad`` gives them).

    Raises:
        TypeError: a leaf of ``params`` is not a tensor, a batch leaf is a DTensor, or the value
            is not a one-element tensor.
        ValueError: a batch tensor is 0-d, or its trailing dims differ between ranks.
    """
    paths, leaves, spec = flatten(params)
    full = []
    for path, leaf in zip(paths, leaves, strict=True):
        x = _full(leaf)
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"reference_value_and_grad: params{_at(path)} is a {type(x).__name__}; params "
                "holds tensors only (DTensors, LocalShards or full tensors)."
            )
        differentiable = x.is_floating_point() or x.is_complex()
        full.append(x.detach().requires_grad_(differentiable))
    distributed = dist.is_initialized()
    everyone = [_concat(f"batch[{i}]", b, group) for i, b in enumerate(batch)]
    wanted = [x for x in full if x.requires_grad]
    with torch.enable_grad():
        value = _checked(loss_fn(unflatten(spec, full), *everyone))
        found = iter(
            torch.autograd.grad(value, wanted, allow_unused=True)
            if wanted and value.requires_grad
            else [None] * len(wanted)
        )
    # integer leaves get None (as fs.value_and_grad gives them); unused float leaves zeros
    grads = [
        (g if (g := next(found)) is not None else torch.zeros_like(x)) if x.requires_grad else None
        for x in full
    ]
    if distributed:
        with torch.no_grad():
            value = _checked(loss_fn(unflatten(spec, [x.detach() for x in full]), *batch))
    return value.detach(), unflatten(spec, grads)


def _full(leaf: Any) -> Any:
    if isinstance(leaf, LocalShard):
        leaf = from_local(leaf)
    if isinstance(leaf, DTensor):
        return leaf.full_tensor()
    return leaf


def _at(path: str) -> str:
    return "" if path == "<root>" else f"[{path!r}]"


def _checked(value: Any) -> torch.Tensor:
    if not (isinstance(value, torch.Tensor) and value.numel() == 1):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(
            f"reference_value_and_grad: loss_fn must return a one-element tensor, got {got}."
        )
    return value


def _concat(name: str, tree: Any, group: dist.ProcessGroup | None) -> Any:
    """The tensors of ``tree`` concatenated over the ranks of ``group`` along dim 0."""
    if not dist.is_initialized():
        return tree
    return map_with_path(lambda p, x: _concat_leaf(_join(name, p), x, group), tree)


def _join(name: str, path: str) -> str:
    if path == "<root>":
        return name
    return name + (path if path.startswith("[") else f".{path}")


def _concat_leaf(name: str, x: Any, group: dist.ProcessGroup | None) -> Any:
    if isinstance(x, DTensor | LocalShard):
        raise TypeError(
            f"reference_value_and_grad: {name} is sharded ({type(x).__name__}); pass each "
            "rank's own batch as a plain tensor."
        )
    if not isinstance(x, torch.Tensor):
        return x
    if x.dim() == 0:
        raise ValueError(
            f"reference_value_and_grad: {name} is a 0-d tensor and cannot be concatenated over "
            "ranks along dim 0; let loss_fn close over it instead."
        )
    shapes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, tuple(x.shape), group=group)
    if len({s[1:] for s in shapes}) != 1:
        raise ValueError(
            f"reference_value_and_grad: {name} has shapes {[list(s) for s in shapes]} on the "
            "ranks; they must agree in every dim but dim 0."
        )
    longest = max(s[0] for s in shapes)
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x.detach()
    pieces = [torch.empty_like(padded) for _ in shapes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece[: s[0]] for piece, s in zip(pieces, shapes, strict=True)])
