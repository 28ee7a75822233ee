"""Grouping policies and ``group``: which parameters are gathered together.

Policies decide, as FSDP1's auto-wrap policies do, which modules become groups.
``group`` then assigns parameters to groups with FSDP1's rules
(``_get_fully_sharded_module_to_states`` in torch 2.0's ``fsdp/_wrap_utils.py``): every
non-ignored parameter exactly once; a parameter reachable from several groups goes to the first
group in depth-first ``.modules()`` order; the root is always a group; groups come in depth-first
order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from torch import nn

from .._trees._extract import aliases, check_not_wrapped


class Policy:
    """Base of the grouping policies: ``policy(name, module, unassigned_numel) -> bool``.

    ``unassigned_numel`` counts the module's parameters not already claimed by a group below it
    (FSDP1's ``nonwrapped_numel``); only size-based policies use it.
    """

    def __call__(self, name: str, module: nn.Module, unassigned_numel: int) -> bool:
        raise NotImplementedError(
            f"{type(self).__name__} subclasses Policy without __call__(name, module, "
            "unassigned_numel); implement it, or use fs.policy.by_predicate(fn)."
        )

    def descend(self, module: nn.Module, numel: int) -> bool:
        """Whether to consider ``module`` (``numel`` parameters) and look inside it at all.

        As FSDP1's ``recurse=True`` policy call: ``False`` keeps the whole subtree out of groups.
        """
        return True

    def check(self, root: nn.Module) -> None:
        """Raise if the policy cannot apply to ``root``."""


@dataclasses.dataclass(frozen=True)
class _ByType(Policy):
    types: tuple[type[nn.Module], ...]

    def __call__(self, name, module, unassigned_numel):
        return isinstance(module, self.types)


@dataclasses.dataclass(frozen=True)
class _BySize(Policy):
    min_params: int
    leaf_types: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
    excluded_types: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)

    def __call__(self, name, module, unassigned_numel):
        return unassigned_numel >= self.min_params and not isinstance(module, self.excluded_types)

    def descend(self, module, numel):
        return numel >= self.min_params and not isinstance(module, self.leaf_types)


@dataclasses.dataclass(frozen=True)
class _ByPredicate(Policy):
    fn: Callable[[str, nn.Module], bool]

    def __call__(self, name, module, unassigned_numel):
        return bool(self.fn(name, module))


@dataclasses.dataclass(frozen=True)
class _ByNames(Policy):
    names: frozenset[str]

    def __call__(self, name, module, unassigned_numel):
        return name in self.names

    def check(self, root):
        unknown = sorted(self.names - {n for n, _ in root.named_modules()})
        if unknown:
            raise ValueError(
                f"policy.by_names: no module named {unknown} in {type(root).__name__}; use fqns "
                "from module.named_modules(), e.g. 'layers.0'."
            )


@dataclasses.dataclass(frozen=True)
class _AnyOf(Policy):
    policies: tuple[Policy, ...]

    def __call__(self, name, module, unassigned_numel):
        return any(p(name, module, unassigned_numel) for p in self.policies)

    def descend(self, module, numel):
        return any(p.descend(module, numel) for p in self.policies)

    def check(self, root):
        for p in self.policies:
            p.check(root)


def by_type(*module_classes: type[nn.Module]) -> Policy:
    """Modules that are instances of one of ``module_classes`` (FSDP's ``ModuleWrapPolicy``)."""
    if not module_classes or not all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in module_classes
    ):
        raise TypeError(f"policy.by_type takes nn.Module subclasses, got {module_classes!r}.")
    return _ByType(tuple(module_classes))


def by_size(min_params: int) -> Policy:
    """Modules with at least ``min_params`` parameters not already in a group below them.

    As FSDP1's ``size_based_auto_wrap_policy``: decided bottom-up; ``ModuleList``/``ModuleDict``
    are never groups; ``MultiheadAttention`` is neither a group nor looked into (its parameters
    go to the group above it).
    """
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 0:
        raise ValueError(f"policy.by_size needs a non-negative int, got {min_params!r}.")
    return _BySize(min_params)


def by_predicate(fn: Callable[[str, nn.Module], bool]) -> Policy:
    """Modules for which ``fn(fqn, module)`` is true."""
    if not callable(fn):
        raise TypeError(f"policy.by_predicate takes a callable (fqn, module) -> bool, got {fn!r}.")
    return _ByPredicate(fn)


def by_names(module_fqns: Iterable[str]) -> Policy:
    """The modules with these fully qualified names (as in ``named_modules()``)."""
    if isinstance(module_fqns, str):
        module_fqns = [module_fqns]
    return _ByNames(frozenset(module_fqns))


def any_of(*policies: Policy) -> Policy:
    """Modules selected by at least one of ``policies``."""
    if not all(isinstance(p, Policy) for p in policies):
        raise TypeError(f"policy.any_of takes funcshard policies, got {policies!r}.")
    return _AnyOf(tuple(policies))


def group(
    module: nn.Module,
    policy: Policy | None = None,
    ignored: Iterable[str | nn.Module | nn.Parameter] = (),
) -> dict[str, list[str]]:
    """Assign the module's parameters to groups: ``{group name: [parameter fqns]}``.

    A group is named by its module's fqn (``""`` for the root). Parameter fqns are those of
    :func:`~funcshard.extract` (a tied parameter under its first name). Groups come in depth-first
    ``.modules()`` order; a group may be empty when its parameters belong to an earlier group.

    Args:
        module: the root module.
        policy: which submodules become groups (``None``: only the root).
        ignored: parameters or modules (objects or fqns) left out of every group; they are not
            sharded by the scheduler and must be passed as plain tensors.

    Raises:
        ValueError: a module is already wrapped by FSDP / ``fully_shard``; an ignored name is
            not a parameter or module of ``module``; ``by_names`` names an unknown module.
    """
    check_not_wrapped(module, "group")
    if policy is not None:
        policy.check(module)
    names = _param_names(module)
    ignored_modules, ignored_params = _resolve_ignored(module, ignored, names)
    selected = {module}
    if policy is not None:
        _select(module, "", policy, ignored_modules, ignored_params, names, selected, {})
    groups: dict[str, list[str]] = {}
    visited = set(ignored_params)
    for fqn, m in module.named_modules():
        if m not in selected:
            continue
        groups[fqn] = []
        stack = [(fqn, m)]
        while stack:  # depth-first, not entering other groups
            prefix, sub = stack.pop()
            for pname, _p in sub.named_parameters(recurse=False):
                name = names[f"{prefix}.{pname}" if prefix else pname]
                if name not in visited:
                    visited.add(name)
                    groups[fqn].append(name)
            children = [(f"{prefix}.{n}" if prefix else n, c) for n, c in sub.named_children()]
            stack.extend(
                c
                for c in reversed(children)
                if c[1] not in selected and c[1] not in ignored_modules
            )
    return groups


def _param_names(module: nn.Module) -> dict[str, str]:
    """Every parameter path (aliases included) -> the name ``extract`` gives that parameter."""
    alias = aliases(module)
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = alias.get(name, first.setdefault(id(p), name))
    return out


def _select(module, fqn, policy, ignored_modules, ignored_params, names, selected, seen) -> int:
    """FSDP1's ``_recursive_wrap``, recording instead of wrapping. Returns the numel claimed.

    A module reached again through another parent (a shared module) is not visited twice; it
    reports the numel it claimed the first time, as FSDP1's second visit would.
    """
    if module in ignored_modules:
        return 0
    if module in seen:
        return seen[module]
    seen[module] = 0
    own = {  # nn.Module's own walk: wrappers (checkpoint_wrapper) rename in their override
        names[f"{fqn}.{n}" if fqn else n]: p
        for n, p in nn.Module.named_parameters(module, remove_duplicate=False)
    }
    total = sum(p.numel() for n, p in own.items() if n not in ignored_params)
    if not policy.descend(module, total):
        return 0
    claimed = sum(
        _select(
            c,
            f"{fqn}.{n}" if fqn else n,
            policy,
            ignored_modules,
            ignored_params,
            names,
            selected,
            seen,
        )
        for n, c in module.named_children()
    )
    if policy(fqn, module, total - claimed):
        selected.add(module)
        claimed = total
    seen[module] = claimed
    return claimed


def _resolve_ignored(module, ignored, names) -> tuple[set[nn.Module], set[str]]:
    modules_by_name = dict(module.named_modules())
    params_by_id = {id(p): names[n] for n, p in module.named_parameters(remove_duplicate=False)}
    ignored_modules: set[nn.Module] = set()
    ignored_params: set[str] = set()
    for item in ignored:
        if isinstance(item, nn.Parameter) and id(item) in params_by_id:
            ignored_params.add(params_by_id[id(item)])
        elif isinstance(item, nn.Module) and any(item is m for m in modules_by_name.values()):
            ignored_modules.add(item)
        elif isinstance(item, str) and item in names:
            ignored_params.add(names[item])
        elif isinstance(item, str) and item in modules_by_name:
            ignored_modules.add(modules_by_name[item])
        else:
            raise ValueError(
                f"group: ignored entry {item!r} is not a parameter or submodule of "
                f"{type(module).__name__}; pass objects or fqns from named_parameters() / "
                "named_modules()."
            )
    for m in list(ignored_modules):  # an ignored module's whole subtree is ignored (FSDP1)
        prefix = next(n for n, x in modules_by_name.items() if x is m)
        ignored_modules.update(m.modules())
        for n, _ in m.named_parameters(remove_duplicate=False):
            ignored_params.add(names[f"{prefix}.{n}" if prefix else n])
    return ignored_modules, ignored_params
