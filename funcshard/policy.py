"""Grouping policies for :func:`funcshard.group` and :func:`funcshard.plan`.

``by_type(*classes)``, ``by_size(min_params)``, ``by_predicate(fn)``, ``by_names(fqns)`` and
``any_of(*policies)``; all are frozen, comparable data.
"""

from ._plans._grouping import Policy, any_of, by_names, by_predicate, by_size, by_type

__all__ = ["Policy", "any_of", "by_names", "by_predicate", "by_size", "by_type"]
