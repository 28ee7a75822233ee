"""DTensors straight into ``torch.func``: the local shard of a DTensor, and back, as autograd
Functions that every transform understands.

[Note: DTensor trees inside torch.func]
``torch.func`` transforms wrap their DTensor inputs into plain functorch tensors, and DTensor's
own ``to_local`` / ``from_local`` are old-style autograd Functions that the transforms refuse.
:class:`ToLocal` and :class:`FromLocal` are a new-style pair, each the other's backward, with the
shard's static spec passed as an argument (read before the call, from the DTensor under the
functorch wrappers: a Function's ``forward`` gets the DTensor itself, ``setup_context`` the
wrappers). Their ``jvp`` maps the tangent the same way, and their ``vmap`` rules keep batch dims
as dims of the DTensor: the local shard of a stacked ensemble keeps its member dim, and a
gradient batched by ``vmap`` or ``jacrev`` becomes a DTensor with the batch dims in front and
its ``Shard`` dims shifted (``[B, *shape]``, ``Shard(d + 1)``). So ``grad``, ``vjp``, ``jvp``,
``jacrev``, ``vmap``, ``hessian``-free compositions and grad of grad take and return DTensors,
whether the tree is passed as an argument, as a tangent, or closed over.

[Note: jvp needs one op of DTensor's]
``torch.func.jvp`` with DTensor primals calls ``aten._has_same_storage_numel`` on the primal and
its tangent before any of our code runs, and DTensor has no rule for that bool-returning op
(``register_sharding`` only describes tensor outputs). DTensor's dispatcher takes custom
handlers (``_custom_op_handlers``, private, as torch itself uses for ``is_same_size``): ours asks
the same question of the local tensors. ``tests/test_func_direct.py`` runs ``jvp`` on DTensor
trees, so a torch upgrade that changes this fails there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .._runtime._compat import compiling
from .._runtime._mode import refuse_jacfwd, transformed

_aten = torch.ops.aten


def unwrap(x: torch.Tensor) -> torch.Tensor:
    """``x`` without the functorch wrappers of the transforms it is under."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _local(x: DTensor) -> torch.Tensor:
    # the attribute, not to_local(): DTensor's own (old-style) autograd stays out, and a call
    # per leaf per step stays cheap
    return x._local_tensor


def _as_dtensor(local: torch.Tensor, spec) -> DTensor:
    """The DTensor ``spec`` describes, around ``local`` (no copy, no communication).

    [Note: DTensors built from their spec]
    ``DTensor.from_local`` costs about a millisecond per call on CPU (an old-style autograd
    Function and its checks), paid per parameter per step when gradients are made into DTensors;
    building the DTensor from its spec costs about 25 us. ``DTensorSpec`` / ``TensorMeta`` are
    private: ``tests/test_func_direct.py`` compares the result with ``from_local``'s, so that a
    torch upgrade that changes them fails there.

    [Note: one DTensorSpec per layout]
    The ``DTensorSpec`` is made once per layout and dtype and shared (DTensor's own operators
    share their inputs' specs too): building one is most of a wrapping's cost, and tensors of
    the same layout -- a parameter, its gradient, its optimizer states -- then have the same
    spec object, which is how the optimizer checks "placed like the parameter" in one identity
    test (see [Note: the common step checked in one pass] in ``optim/_adam_sgd``).
    """
    return DTensor(local.detach(), _dtensor_spec(spec, local.dtype), requires_grad=False)


# (ShardSpec, dtype) -> its DTensorSpec. Checked for the mesh's identity: two meshes of the
# same ranks compare equal (a fake world's and a real one, or one made again after a group was
# destroyed), and a DTensor must keep its own.
_SPECS: dict[tuple[Any, torch.dtype], DTensorSpec] = {}
_SPECS_KEPT = 4096


def _dtensor_spec(spec, dtype: torch.dtype) -> DTensorSpec:
    """The shared ``DTensorSpec`` of ``spec`` (a ``ShardSpec``) and ``dtype`` (see [Note: one
    DTensorSpec per layout])."""
    key = (spec, dtype)
    found = _SPECS.get(key)
    if found is None or found.mesh is not spec.mesh:
        if len(_SPECS) >= _SPECS_KEPT:
            _SPECS.clear()
        meta = TensorMeta(torch.Size(spec.shape), tuple(spec.stride), dtype)
        found = _SPECS[key] = DTensorSpec(spec.mesh, tuple(spec.placements), tensor_meta=meta)
    return found


def placed_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as a DTensor placed like ``like`` (its mesh, placements, global shape and
    stride; ``local``'s dtype): see [Note: DTensors built from their spec]. Of ``like``'s dtype,
    it shares ``like``'s spec (see [Note: one DTensorSpec per layout])."""
    if local.dtype == like.dtype:
        dspec = like._spec
    else:
        meta = TensorMeta(like.shape, like.stride(), local.dtype)
        dspec = DTensorSpec(like.device_mesh, like.placements, tensor_meta=meta)
    return DTensor(local.detach(), dspec, requires_grad=False)


@functools.lru_cache(maxsize=1024)
def _stacked(spec, size: int):
    """``spec`` with a new leading dim of ``size`` (unsharded)."""
    shape = (size, *spec.shape)
    return dataclasses.replace(
        spec,
        placements=tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in spec.placements),
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )


def locals_of(leaves, specs) -> list[torch.Tensor]:
    """The local shards of DTensor ``leaves`` (maybe under functorch wrappers, or closed over),
    in one autograd call for the whole tree (see [Note: one call per tree]).

    Raises:
        NotImplementedError: DTensors under ``torch.func`` transforms while ``torch.compile``
            traces (see [Note: torch.func over DTensors under torch.compile]).
    """
    if leaves and compiling() and any(unwrap(x) is not x for x in leaves):
        raise NotImplementedError(_COMPILED_TRANSFORM)
    return list(ToLocal.apply(_Specs(specs), *leaves)) if leaves else []


# [Note: torch.func over DTensors under torch.compile]
# Compiled, a torch.func transform over a DTensor tree hands our rules cotangents that are
# functional tensors rather than DTensors (torch 2.13): what they carry cannot be checked, and a
# rank that fails there leaves the others in a collective. So it is refused, on every rank alike
# and before any collective; the LocalShard form compiles (tests/test_compile.py).
_COMPILED_TRANSFORM = (
    "funcshard: torch.func transforms over DTensor trees do not compile (torch 2.13). Under "
    "torch.compile, pass fs.to_local(tree) to the transform and fs.from_local its result "
    "(docs/compile.md), or call the transform without torch.compile."
)


def dtensors_of(locals_, specs) -> list[DTensor]:
    """DTensors with ``specs`` from local shards, in one autograd call."""
    return list(FromLocal.apply(_Specs(specs), *locals_)) if locals_ else []


class _Specs(tuple):
    """The specs of a call's tensors: one opaque argument (a plain tuple would be flattened,
    spec by spec, by every autograd.Function call under functorch)."""


# [Note: one call per tree]
# Under a transform, each autograd.Function call costs functorch a Function class built for
# the call (signature inspection included): per leaf, that made the direct form slower than the
# conversion form. One call per tree keeps the cost per step, not per parameter.


class ToLocal(torch.autograd.Function):
    """DTensors -> their local shards; backward :class:`FromLocal`. ``specs``: ``ShardSpec``s."""

    @staticmethod
    def forward(specs, *xs):
        return tuple(_checked_local(x, s) for x, s in zip(xs, specs, strict=True))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.specs = inputs[0]
        ctx.like = [(o.shape, o.dtype, o.device) for o in output]
        _keep_frozen(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *FromLocal.apply(ctx.specs, *grads))

    @staticmethod
    def jvp(ctx, _, *tangents):
        refuse_jacfwd("a sharded parameter", ctx.specs[0].mesh.size())
        given = [i for i, t in enumerate(tangents) if t is not None]
        specs, ts = _Specs(ctx.specs[i] for i in given), [tangents[i] for i in given]
        return _fill(_call(ToLocal, specs, ts), given, ctx.like)

    @staticmethod
    def vmap(info, in_dims, specs, *xs):
        moved, new_specs, out_dims = [], [], []
        for x, spec, bdim in zip(xs, specs, in_dims[1:], strict=True):
            if bdim is not None and x.dim() > len(spec.shape):  # a batch dim of its own
                x, spec = x.movedim(bdim, 0) if bdim else x, _stacked(spec, info.batch_size)
                bdim = 0
            elif bdim is not None:  # the batch dim is one of the DTensor's (an ensemble)
                _check_unsharded(spec, bdim)
            moved.append(x)
            new_specs.append(spec)
            out_dims.append(bdim)
        return ToLocal.apply(_Specs(new_specs), *moved), tuple(out_dims)


class FromLocal(torch.autograd.Function):
    """Local shards -> the DTensors ``specs`` describe; backward :class:`ToLocal`."""

    @staticmethod
    def forward(specs, *locals_):
        return tuple(_as_dtensor(t, s) for t, s in zip(locals_, specs, strict=True))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.specs = inputs[0]
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs[1:]]
        _keep_frozen(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ToLocal.apply(ctx.specs, *grads))

    @staticmethod
    def jvp(ctx, _, *tangents):
        given = [i for i, t in enumerate(tangents) if t is not None]
        full = _fill([tangents[i] for i in given], given, ctx.like)  # zeros: shards, not DTensors
        return _call(FromLocal, ctx.specs, full)

    @staticmethod
    def vmap(info, in_dims, specs, *locals_):
        moved, new_specs, out_dims = [], [], []
        for t, spec, b in zip(locals_, specs, in_dims[1:], strict=True):
            if b is not None:
                t = t.movedim(b, 0)
                if t.dim() > len(spec.shape):  # a batch dim of its own: in front of the DTensor's
                    spec = _stacked(spec, info.batch_size)
            moved.append(t)
            new_specs.append(spec)
            out_dims.append(None if b is None else 0)
        return FromLocal.apply(_Specs(new_specs), *moved), tuple(out_dims)


def _call(function, specs, tensors) -> tuple:
    """A rule's inner ``function.apply``, or its ``forward`` when the tensors need no autograd
    (no transform below, no gradient): one Function call fewer (see [Note: one call per tree])."""
    if tensors and not transformed() and not any(t.requires_grad for t in tensors):
        return function.forward(specs, *tensors)
    return function.apply(specs, *tensors)


def _keep_frozen(ctx, inputs, outputs) -> None:
    """A Function's outputs all require grad if any input does: keep frozen leaves frozen (no
    gradient, no communication; see [Note: frozen leaves] in ``_autodiff``). Plain autograd
    only: inside ``torch.func`` transforms, what is differentiated is what the transform is
    given (``requires_grad`` does not describe forward-mode duals)."""
    if not transformed():
        frozen = [y for x, y in zip(inputs, outputs, strict=True) if not x.requires_grad]
        ctx.mark_non_differentiable(*frozen)


def _checked_local(x, spec) -> torch.Tensor:
    if isinstance(x, DTensor) and tuple(x.placements) != spec.placements and _partial(x, spec):
        # the gradient of a tensor-parallel parameter, reduced as TP does (see [Note: the 2-D
        # layout] in _parallel): a replicated weight used on sharded activations gets Partial
        x = x.redistribute(spec.mesh, spec.placements)
    if not isinstance(x, DTensor) or tuple(x.placements) != spec.placements:
        got = tuple(x.placements) if isinstance(x, DTensor) else type(x).__name__
        raise ValueError(
            f"a DTensor placed as {spec.placements} got a tangent or cotangent placed as {got}: "
            "shard tangents like their primals (fs.shard(tangent, mesh) with the same placements)."
        )
    local = _local(x)
    return local.view_as(local)


def _partial(x: DTensor, spec) -> bool:
    """Whether ``x`` is ``spec``'s DTensor with some placements ``Partial`` instead."""
    return x.device_mesh == spec.mesh and all(
        p == q or p.is_partial() for p, q in zip(x.placements, spec.placements, strict=True)
    )


def _check_unsharded(spec, bdim: int) -> None:
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim == bdim:
            refuse_jacfwd("a sharded parameter", spec.mesh.size())  # its basis is sharded
            raise ValueError(
                f"vmap over dim {bdim} of a DTensor sharded along it ({spec.placements}): each "
                "rank holds different members. Stack members along an unsharded dim and shard "
                "another one (e.g. fs.shard(stacked, mesh, Shard(1)))."
            )


def _fill(out, given, like) -> tuple[torch.Tensor, ...]:
    """Tangents for every output: ``out`` where given, zeros elsewhere."""
    full = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in like]
    for i, t in zip(given, out, strict=True):
        full[i] = t
    return tuple(full)


def _same_storage_numel(op, args, kwargs):
    """See [Note: jvp needs one op of DTensor's]."""
    a, b = (x._local_tensor if isinstance(x, DTensor) else x for x in args)
    return op(a, b, **(kwargs or {}))


DTensor._op_dispatcher._custom_op_handlers.setdefault(
    _aten._has_same_storage_numel.default, _same_storage_numel
)
