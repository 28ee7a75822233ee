"""``extract`` parameters from a module, and ``functional_call`` that keeps tied weights tied.

[Note: remembering ties]
Ties are module structure, but ``module.to("meta")`` -- the usual way to drop a module's own
storage once its parameters live in a sharded tree -- gives each alias its own meta tensor, and
``torch.func.functional_call`` then leaves the alias on meta. ``extract`` therefore records the
module's aliases (``{alias fqn: first fqn}``) in a weak, module-keyed table, and funcshard's
``functional_call`` and ``group`` read it: a fact about the module taken when it was intact, not
state that changes behaviour later.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.func
from torch import nn

_ALIASES: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def extract(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's parameters and buffers as flat dicts ``fqn -> tensor`` (no copies).

    In ``named_parameters()`` / ``named_buffers()`` order. A tied tensor appears once, under its
    first name; the other names are remembered so that :func:`functional_call` (and
    :func:`~funcshard.group`) keep it tied, even after ``module.to("meta")``.
    """
    _ALIASES[module] = _live_aliases(module)
    return dict(module.named_parameters()), dict(module.named_buffers())


def _live_aliases(module: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    aliases = {}
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, t in named:
        canonical = first.setdefault(id(t), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def aliases(module: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for tied tensors, as recorded by :func:`extract` (or live)."""
    return {**_live_aliases(module), **_ALIASES.get(module, {})}


def functional_call(
    module: nn.Module,
    parameter_and_buffer_dicts: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    args: Any = None,
    kwargs: dict[str, Any] | None = None,
    *,
    tie_weights: bool = True,
    strict: bool = False,
) -> Any:
    """``torch.func.functional_call``, plus the ties recorded by :func:`extract`.

    Same signature and semantics. With ``tie_weights=True``, every alias recorded when the module
    was extracted gets the value given for its first name (unless given itself), so a tied
    embedding/head stays tied even if the module was moved to meta afterwards.
    """
    dicts = (
        [parameter_and_buffer_dicts]
        if isinstance(parameter_and_buffer_dicts, Mapping)
        else list(parameter_and_buffer_dicts)
    )
    if tie_weights:
        given = {k: v for d in dicts for k, v in d.items()}
        tied = {a: given[c] for a, c in aliases(module).items() if c in given and a not in given}
        if tied:
            dicts = [*dicts, tied]
    if args is None:
        args = ()
    return torch.func.functional_call(
        module, tuple(dicts), args, kwargs, tie_weights=tie_weights, strict=strict
    )
