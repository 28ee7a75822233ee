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

from collections.abc import Callable

import torch
from optree import tree_map

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
_DATA = torch.Tensor.data.__get__


class Deferred(torch.Tensor):
    """A data-less stand-in for the unsharded parameter ``fqn``; ``resolve(fqn)`` returns the
    real tensor. Reports the real tensor's shape, dtype and device."""

    _fqn: str
    _resolve: Callable[[str], torch.Tensor]
    _device: torch.device

    @staticmethod
    def __new__(cls, fqn: str, shape, dtype: torch.dtype, device, resolve) -> Deferred:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t._fqn, t._resolve, t._device = fqn, resolve, torch.device(device)
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
            return Deferred(
                x._fqn, x.shape, x.dtype, x._device, lambda fqn: x._resolve(fqn).detach()
            )
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(
            lambda x: x._resolve(x._fqn) if isinstance(x, Deferred) else x,
            (args, kwargs),
            none_is_leaf=True,
        )
        return func(*args, **kwargs)  # no Deferred left: no recursion
