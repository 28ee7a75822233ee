"""Record the order in which a module uses its parameter groups, from a dry run on meta."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import nn

from ._deferred import Deferred
from ._extract import functional_call


def record_order(module: nn.Module, groups, example_args: Any, example_kwargs) -> list[str]:
    """Run ``module`` once on meta copies of the example inputs, with :class:`Deferred`
    parameters that log their group when used; return the runs (consecutive uses merged).

    No real compute and no communication happen. Groups never used do not appear.

    Raises:
        RuntimeError: the forward cannot run on meta tensors (data-dependent code, .item(),
            ...); pass ``order=`` to :func:`~funcshard.plan` instead.
    """
    group_of = {p: g.name for g in groups for p in g.params}
    shapes = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    recorder = _Recorder(group_of, shapes)
    params = {p: Deferred(p, shapes[p].shape, shapes[p].dtype, "meta", recorder) for p in group_of}
    # buffers and parameters in no group (ignored ones) take part as data-less meta tensors
    others = {k: t for k, t in shapes.items() if k not in group_of}
    buffers = {k: torch.empty_like(t, device="meta") for k, t in others.items()}
    to_meta = lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
    args = example_args if isinstance(example_args, tuple) else (example_args,)
    args, kwargs = optree.tree_map(to_meta, (args, example_kwargs or {}), none_is_leaf=True)
    try:
        with torch.no_grad():
            functional_call(module, (params, buffers), args, kwargs)
    except Exception as e:
        raise RuntimeError(
            f"plan: the dry run of {type(module).__name__} on meta tensors failed ({e!r}). Pass "
            "the forward order of the groups explicitly with plan(..., order=[...])."
        ) from e
    return recorder.runs


class _Recorder:
    """A resolver that logs the groups used and answers with meta tensors."""

    def __init__(self, group_of: dict[str, str], shapes: dict[str, torch.Tensor]) -> None:
        self.group_of, self.shapes = group_of, shapes
        self.runs: list[str] = []

    def resolve(self, fqns) -> list[torch.Tensor]:
        out = []
        for fqn in fqns:
            group = self.group_of[fqn]
            if not self.runs or self.runs[-1] != group:
                self.runs.append(group)
            t = self.shapes[fqn]
            out.append(torch.empty(t.shape, dtype=t.dtype, device="meta"))
        return out

    def release(self) -> None:
        pass
