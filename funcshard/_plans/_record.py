"""Record the order in which a module uses its parameter groups: from a dry run on meta, or from
one real forward over the shards.

[Note: recording from a real forward]
A forward that reads tensor *values* -- ``.item()`` in Hugging Face's mask code, data-dependent
control flow -- cannot run on meta tensors. For those, the order is recorded as FSDP2 learns it
at run time: from a real forward, on the real inputs and the real shards, once. The module runs
without grad on :class:`Deferred` parameters; the first use of a group gathers it (an
``unshard`` of that group alone, in the group's ``param_dtype``) and the start of the next run
frees it, so at most the groups of one operation are unsharded at a time, as in a scheduled
step. Every rank takes part (each gather is a collective).

Ranks that took different paths would issue different gathers, which gloo answers with an
abort or garbage, not an error. So before each new run every rank publishes the group it is
about to use through the process group's store (see ``_consensus``) and reads the others': if
they differ -- or a rank ended its forward, or failed in it -- every rank raises the same error
before any mismatched collective. That costs one store round trip per run, once per plan.

The recording has no effect on the training state: the global RNG is restored afterwards
(dropout draws), and the module computes with copies of its buffers (BatchNorm's running
statistics are not updated).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import nn

from .._communication._consensus import each_rank
from .._trees._deferred import Deferred
from .._trees._extract import aliases, functional_call
from .._trees._spec import as_locals
from ..transforms._unshard import unshard


def _computed(param: torch.Tensor, group) -> torch.dtype:
    """The dtype the schedule gives the module for ``param``: its group's ``param_dtype`` for a
    floating parameter (kernels that take only low precision, as grouped matmuls on meta, then
    run in the dry run as in the step)."""
    if group.param_dtype is not None and param.is_floating_point():
        return group.param_dtype
    return param.dtype


def record_order(
    module: nn.Module,
    groups,
    example_args: Any,
    example_kwargs,
    *,
    sharded: Mapping[str, Any] | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    fn: str = "plan",
) -> list[str]:
    """Run ``module`` once and return the runs of groups it used (consecutive uses merged).

    Without ``sharded``: on meta copies of the example inputs, with shape-only parameters; no
    compute, no communication. With ``sharded`` (the ``{fqn: DTensor}`` tree of
    :func:`~funcshard.shard`): a real forward without grad, collective (see [Note: recording
    from a real forward]). Groups never used do not appear.

    Raises:
        RuntimeError: the forward cannot run on meta tensors (data-dependent code, .item(),
            ...); pass ``sharded=`` (or ``order=`` to :func:`~funcshard.plan`) instead.
        ValueError: with ``sharded``: a parameter of the groups is missing from it; ranks
            used their groups in different orders (on every rank).
    """
    # keyword-only examples (example_args None) call the forward with no positional argument
    if example_args is None:
        args = ()
    else:
        args = example_args if isinstance(example_args, tuple) else (example_args,)
    kwargs = example_kwargs or {}
    if sharded is not None:
        return _real_run(module, groups, sharded, buffers, args, kwargs, fn)
    group_of = {p: g.name for g in groups for p in g.params}
    shapes = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    dtypes = {p: _computed(shapes[p], g) for g in groups for p in g.params}
    recorder = _Recorder(group_of, shapes, dtypes)
    params = {p: Deferred(p, shapes[p].shape, dtypes[p], "meta", recorder) for p in group_of}
    # buffers and parameters in no group (ignored ones) take part as data-less meta tensors;
    # tied aliases follow their first name (functional_call), even if to("meta") untied them
    tied = aliases(module)
    others = {k: t for k, t in shapes.items() if k not in group_of and k not in tied}
    metas = {k: torch.empty_like(t, device="meta") for k, t in others.items()}
    to_meta = lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
    args, kwargs = optree.tree_map(to_meta, (args, kwargs), none_is_leaf=True)
    try:
        with torch.no_grad():
            functional_call(module, (params, metas), args, kwargs)
    except Exception as e:
        order = ", or give the order: plan(..., order=[...])" if fn == "plan" else ""
        raise RuntimeError(
            f"{fn}: the dry run of {type(module).__name__} on meta tensors failed ({e!r}). Record "
            f"from one real forward instead: {fn}(..., sharded=<the shards>, buffers=<the "
            f"buffers>), called on every rank (see docs/schedule.md){order}."
        ) from e
    return recorder.runs


class _Recorder:
    """A resolver that logs the groups used and answers with meta tensors."""

    def __init__(
        self,
        group_of: dict[str, str],
        shapes: dict[str, torch.Tensor],
        dtypes: dict[str, torch.dtype],
    ) -> None:
        self.group_of, self.shapes, self.dtypes = group_of, shapes, dtypes
        self.runs: list[str] = []

    def resolve(self, fqns) -> list[torch.Tensor]:
        out = []
        for fqn in fqns:
            group = self.group_of[fqn]
            if not self.runs or self.runs[-1] != group:
                self.runs.append(group)
            t = self.shapes[fqn]
            out.append(torch.empty(t.shape, dtype=self.dtypes[fqn], device="meta"))
        return out

    def release(self) -> None:
        pass


def _real_run(module, groups, sharded, buffers, args, kwargs, fn) -> list[str]:
    """See [Note: recording from a real forward]."""
    missing = [p for g in groups for p in g.params if p not in sharded]
    if missing:
        raise ValueError(
            f"{fn}: parameters {missing} of the groups are missing from sharded=; pass the dict "
            "from fs.shard(fs.extract(module)[0], mesh) for this module."
        )
    names = [p for g in groups for p in g.params]
    locals_, specs = as_locals(names, [sharded[p] for p in names], fn)
    gatherer = _Gatherer(groups, sharded, fn)
    dtype = {p: g.param_dtype for g in groups for p in g.params}
    params = {  # a 2-D layout's module computes with DTensors
        p: Deferred(p, s.shape, dtype[p] or t.dtype, t.device, gatherer, s.dp_dims is not None)
        for p, t, s in zip(names, locals_, specs, strict=True)
    }
    passed = {k: v for k, v in sharded.items() if k not in params}  # ignored: plain tensors
    tied = aliases(module)
    own = {k: b for k, b in module.named_buffers() if k not in tied and not b.is_meta}
    copies = {k: b.clone() for k, b in {**own, **(buffers or {})}.items()}
    devices = [t.device for t in locals_]
    with _rng_restored(devices), torch.no_grad():
        try:
            functional_call(module, ({**passed, **params}, copies), args, kwargs)
        except Exception as e:
            if not gatherer.failed:  # the other ranks are told, then it goes on
                gatherer.next(f"<failed: {type(e).__name__}>")
            raise
        gatherer.next("<end of forward>")
    return gatherer.runs


class _Gatherer:
    """A resolver over the real shards: gathers a group at the start of each of its runs, frees
    it at the start of the next, and checks with the other ranks at each step."""

    def __init__(self, groups, sharded, fn: str) -> None:
        self.group_of = {p: g.name for g in groups for p in g.params}
        self.groups = {g.name: g for g in groups}
        self.sharded, self.fn = sharded, fn
        self.runs: list[str] = []
        self.full: dict[str, dict[str, torch.Tensor]] = {}  # unsharded groups
        self.failed = False

    def resolve(self, fqns) -> list[torch.Tensor]:
        for name in dict.fromkeys(self.group_of[f] for f in fqns):
            if not self.runs or self.runs[-1] != name:
                self.next(name)
                self.runs.append(name)
            if name not in self.full:
                g = self.groups[name]
                self.full[name] = unshard(
                    {p: self.sharded[p] for p in g.params}, param_dtype=g.param_dtype
                )
        return [self.full[self.group_of[f]][f] for f in fqns]

    def release(self) -> None:
        self.full = {k: v for k, v in self.full.items() if k == self.runs[-1]}

    def next(self, event: str) -> None:
        """Check that every rank's next event (a group about to run, the end, a failure) is
        this one; raise the same error on every rank if not."""
        self.failed = True  # until every rank has answered alike
        seen = each_rank(f"{self.fn}/record", event)
        if len(set(seen)) > 1:
            got = "; ".join(f"rank {r}: {_event(e)}" for r, e in enumerate(seen))
            raise ValueError(
                f"{self.fn}: the ranks' forwards used the groups in different orders, at run "
                f"{len(self.runs)} ({got}; runs so far: {_runs(self.runs)}). The forward takes a "
                "data-dependent path: record with example inputs that take the same path on "
                "every rank (e.g. the same batch everywhere), or give the order with order=."
            )
        self.failed = False


def _event(e: str) -> str:
    return e if e.startswith("<") else repr(e or "<root>")


def _runs(runs) -> str:
    return " -> ".join(r or "<root>" for r in runs) or "none"


@contextlib.contextmanager
def _rng_restored(devices):
    """The global RNG of the CPU and of the shards' accelerator, as it was (see the Note)."""
    kinds = {d.type for d in devices} - {"cpu", "meta"}
    if not kinds:
        with torch.random.fork_rng(devices=[]):
            yield
        return
    (kind,) = kinds
    indices = sorted({d.index or 0 for d in devices})
    with torch.random.fork_rng(devices=indices, device_type=kind):
        yield
