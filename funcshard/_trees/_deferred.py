"""Deferred parameters: what the module sees instead of an unsharded parameter.

[Note: how a group's turn is noticed without hooks]
The scheduler calls the module through ``functional_call`` with a :class:`Deferred` tensor for
each parameter. A ``Deferred`` holds no data; the first torch operation that takes one as an
argument (``F.linear(x, self.weight)``, ``self.weight.t()``, ...) asks the resolver for the
real tensor -- which lets the scheduler advance through the plan to that parameter's group
(gather, wait, free the previous group) -- and then runs on the real tensor. Metadata queries
(shape, dtype, device, ...) are answered without gathering. Nothing is registered anywhere:
the interception is the tensor subclass's own ``__torch_function__``, and it only sees
operations on the parameters themselves.

Caveat (shared with FSDP2): a *view* of a parameter kept in a Python variable and used after
its group was freed is not a Deferred any more; keep parameter uses inside the forward of the
module that owns them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import optree
import torch
from torch.distributed.tensor import DTensor

from .._runtime._compile import compiling, untraced

# Answered from the placeholder's own (meta) metadata, without resolving.
_METADATA = {
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,
}


_DEVICE = torch.Tensor.device.__get__
_CONTAINERS = (list, tuple, dict)  # what may hold a Deferred inside an argument
_DATA = torch.Tensor.data.__get__


class Resolver(Protocol):
    """Who answers for :class:`Deferred` parameters, one torch operation at a time.

    [Note: one operation's parameters are resident together]
    An operation may take parameters of several groups (a weight tied across groups:
    ``layer_norm(x, weight_of_A, bias_of_B)``). Resolving them one by one would let the
    scheduler advance to ``B`` -- and free ``A`` -- before the operation runs. So all of an
    operation's parameters are resolved in one call, and ``release`` follows the operation:
    frees due in between wait for it.

    ``sealed``: the name of a recompute group whose forward is running; while set, resolving a
    parameter of another group refuses (it would get no gradient under ``torch.func``).
    """

    sealed: str | None

    def resolve(self, fqns: Sequence[str]) -> list[torch.Tensor]: ...

    def release(self) -> None: ...


class _Detached:
    """What ``param.data`` resolves to: the same tensors, detached."""

    def __init__(self, inner: Resolver) -> None:
        self.inner = inner

    @property
    def sealed(self) -> str | None:
        return self.inner.sealed

    @sealed.setter
    def sealed(self, value: str | None) -> None:
        self.inner.sealed = value

    def resolve(self, fqns: Sequence[str]) -> list[torch.Tensor]:
        return [t.detach() for t in self.inner.resolve(fqns)]

    def release(self) -> None:
        self.inner.release()


class Deferred(torch.Tensor):
    """A data-less stand-in for the unsharded parameter ``fqn``, answered by ``resolver``.
    Reports the real tensor's shape, dtype and device."""

    _fqn: str
    _resolver: Resolver
    _device: torch.device

    @staticmethod
    def __new__(
        cls, fqn: str, shape, dtype: torch.dtype, device, resolver: Resolver, dtensor=False
    ) -> Deferred:
        """``dtensor``: the real tensor is a DTensor (see :class:`_DeferredDTensor`)."""
        if compiling() or torch._C._len_torch_dispatch_stack():
            # a plain meta tensor, also under a trace's or fs.explain's fake tensor mode
            with untraced():
                placeholder = torch.empty(shape, dtype=dtype, device="meta")
        else:
            placeholder = _placeholder(tuple(shape), dtype)
        t = torch.Tensor._make_subclass(_DeferredDTensor if dtensor else cls, placeholder)
        t._fqn, t._resolver, t._device = fqn, resolver, torch.device(device)
        return t

    def __repr__(self) -> str:
        return f"Deferred({self._fqn!r}, shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE:  # method-wrappers compare equal, but are not identical
            return args[0]._device
        if func == _DATA:  # stays deferred: resolves to the detached tensor
            x = args[0]
            dtensor = isinstance(x, _DeferredDTensor)
            return Deferred(x._fqn, x.shape, x.dtype, x._device, _Detached(x._resolver), dtensor)
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if not kwargs and not any(isinstance(a, _CONTAINERS) for a in args):
            # the common case (``F.linear(x, w, b)``, ``x * w``): no tree to flatten
            real, resolvers = resolve_all(args)
            try:
                return func(*real)  # no Deferred left: no recursion
            finally:
                release_all(resolvers)
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        real, resolvers = resolve_all(leaves)
        try:
            args, kwargs = optree.tree_unflatten(spec, real)
            return func(*args, **kwargs)  # no Deferred left: no recursion
        finally:
            release_all(resolvers)


@functools.lru_cache(maxsize=4096)
def _placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of ``shape`` and ``dtype``, made once: each :class:`Deferred` is a new
    tensor over it (``_make_subclass``), so a call does not create one per parameter."""
    return torch.empty(shape, dtype=dtype, device="meta")


# DTensor's attributes that live on its instances rather than its class
_DTENSOR_FIELDS = frozenset({"_local_tensor", "_spec"})


class _DeferredDTensor(Deferred):
    """The stand-in of a parameter the module computes with as a DTensor (a 2-D layout's: FSDP
    x TP or EP, see [Note: the 2-D layout] in ``_parallel``).

    [Note: a stand-in that passes for a DTensor]
    Model code branches on the parameter's type: torchtitan's ``GroupedExperts`` runs
    ``w = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1`` (expert parallel
    tokens have data-dependent counts, which DTensor cannot express). Under FSDP2 the module
    holds the unsharded DTensor, so that works; a plain ``Deferred`` would take the other branch
    and fail on mixed DTensor / tensor operands. So this stand-in reports ``DTensor`` as its
    ``__class__`` (what ``isinstance`` consults after ``type``, as ``unittest.mock`` does with
    ``spec=``), and DTensor's own methods and attributes (``to_local``, ``placements``,
    ``device_mesh``, ``redistribute``, ``full_tensor``, ...) resolve it like any operation: the
    call runs on the real DTensor while its group is resident. ``type(p)`` stays this class.
    """

    @property
    def __class__(self):
        return DTensor

    def __getattr__(self, name: str):
        if name.startswith("__") or not (hasattr(DTensor, name) or name in _DTENSOR_FIELDS):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if callable(getattr(DTensor, name, None)):
            return lambda *a, **k: _on_real(self, lambda x: getattr(x, name)(*a, **k))
        return _on_real(self, lambda x: getattr(x, name))


def _on_real(x: Deferred, fn):
    """``fn`` of the real tensor behind ``x``, resolved for this one use."""
    (real,), resolvers = resolve_all([x])
    try:
        return fn(real)
    finally:
        release_all(resolvers)


def resolve_all(leaves: Sequence) -> tuple[list, list[Resolver]]:
    """``leaves`` with each :class:`Deferred` replaced by its real tensor, and the resolvers
    to :func:`release_all` once the operation on them ran (see [Note: one operation's
    parameters are resident together])."""
    leaves = list(leaves)
    by_resolver: dict[int, tuple[Resolver, list[int]]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, Deferred):
            by_resolver.setdefault(id(x._resolver), (x._resolver, []))[1].append(i)
    done = []
    try:
        for resolver, where in by_resolver.values():
            done.append(resolver)
            real = resolver.resolve([leaves[i]._fqn for i in where])
            for i, t in zip(where, real, strict=True):
                leaves[i] = t
    except BaseException:
        release_all(done)
        raise
    return leaves, done


def release_all(resolvers: Sequence[Resolver]) -> None:
    for resolver in resolvers:
        resolver.release()
