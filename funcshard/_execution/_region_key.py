"""A region's key known before it is traced: which groups will compute the same graphs.

[Note: identical groups known before tracing]
Two calls of group modules trace the same joint graph when the same code runs on tensors of the
same metadata: the modules are of the same types with equal attributes, the forward is the same
function, its non-tensor arguments are equal, its tensors (arguments, then the module's
parameters) have the same shapes, strides, dtypes, devices and ``requires_grad``, and the state
torch traces under (grad mode, autocast, dispatch keys) is the same. :func:`known` is that key;
``_regions`` traces the joint graph of the first group with a key and hands its graphs to every
later one, so the Python of a block runs once per distinct block, not once per block (as
``jax.lax.scan`` traces its body once).

What the key cannot see, it refuses: a module with hooks (they may change the computation) has
no key and is traced, as is every group under ``torch.compile``'s earlier passes. Attributes
that are not plain values (numbers, strings, dtypes, tuples of them) enter the key by identity:
two blocks sharing one config object share the key; two blocks holding equal but distinct
objects are traced each, and the traced code then decides (``_regions``' key of the code).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, enum.Enum)
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_DEVICES = ("cpu", "cuda")  # autocast's
_SKIPPED = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def known(call: Any, real: list[torch.Tensor]) -> Hashable | None:
    """The key of a region's call (a ``_recompute._Call`` and its tensors), or ``None`` if it
    cannot be known before tracing."""
    module = _module(call.module)
    if module is None or _global_hooks():
        return None
    forward = getattr(call.forward, "__func__", call.forward)
    bound_to = getattr(call.forward, "__self__", call.module)
    if bound_to is not call.module:
        return None
    meta = tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in real)
    state = (
        torch.is_grad_enabled(),
        tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICES),
        repr(torch._C._dispatch_tls_local_include_set()),
        repr(torch._C._dispatch_tls_local_exclude_set()),
    )
    leaves = tuple(_value(x) for x in call.leaves)
    return (module, forward, call.spec, leaves, call.names, call.is_buffer, meta, state)


def _module(root: nn.Module) -> tuple | None:
    """Every submodule's type and plain attributes (values, or identities), or ``None`` if one
    has hooks."""
    parts = []
    for name, m in root.named_modules(remove_duplicate=False):
        if any(getattr(m, h, None) for h in _HOOKS):
            return None
        attrs = []
        for k, v in vars(m).items():
            if k in _SKIPPED or (k.startswith("_") and "hook" in k):
                continue
            if k == "forward" and m is root:  # the region's own wrapper: the call's forward
                continue
            attrs.append((k, _value(v)))
        parts.append((name, type(m), tuple(attrs)))
    return tuple(parts)


def _value(v: Any) -> Hashable:
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if type(v) in (tuple, list, frozenset):
        return (type(v), tuple(_value(x) for x in v))
    return ("id", id(v))


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return any(
        getattr(torch_module, name, None)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )
