"""funcshard: functional ZeRO-3 sharding for PyTorch, as pure transforms over pytrees."""

from . import checkpoint, optim, policy, testing
from ._communication._debug import checking_collectives
from ._execution._autodiff import grad, per_sample_grad, value_and_grad
from ._execution._cuda_graph import cuda_graph
from ._execution._jit import jit
from ._execution._schedule import schedule
from ._plans._bucketing import merge_groups
from ._plans._grouping import group
from ._plans._plan import Group, Plan, Step, plan
from ._pricing._autoplan import Autoplanned, Tried, autoplan
from ._pricing._explain import Collective, Explanation, GroupCost, Hardware, Moment, explain
from ._trees._construction import Construction, on_meta
from ._trees._extract import extract, functional_call
from ._trees._spec import LocalShard, ShardSpec, from_local, to_local, tree_map
from .transforms import reduce, shard, unshard
from .transforms._materialize import materialize

__all__ = [
    "Autoplanned",
    "Collective",
    "Construction",
    "Explanation",
    "Group",
    "GroupCost",
    "Hardware",
    "LocalShard",
    "Moment",
    "Plan",
    "ShardSpec",
    "Step",
    "Tried",
    "autoplan",
    "checking_collectives",
    "checkpoint",
    "cuda_graph",
    "explain",
    "extract",
    "from_local",
    "functional_call",
    "grad",
    "group",
    "jit",
    "materialize",
    "merge_groups",
    "on_meta",
    "optim",
    "per_sample_grad",
    "plan",
    "policy",
    "reduce",
    "schedule",
    "shard",
    "testing",
    "to_local",
    "tree_map",
    "unshard",
    "value_and_grad",
]
