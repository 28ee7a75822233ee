"""funcshard: functional ZeRO-3 sharding for PyTorch, as pure transforms over pytrees."""

from . import checkpoint, optim, policy, testing
from ._autodiff import grad, per_sample_grad, value_and_grad
from ._autoplan import Autoplanned, Tried, autoplan
from ._bucketing import merge_groups
from ._construction import Construction, on_meta
from ._cuda_graph import cuda_graph
from ._debug import checking_collectives
from ._explain import Collective, Explanation, GroupCost, Hardware, Moment, explain
from ._extract import extract, functional_call
from ._grouping import group
from ._materialize import materialize
from ._plan import Group, Plan, Step, plan
from ._schedule import schedule
from ._spec import LocalShard, ShardSpec, from_local, to_local, tree_map
from .transforms import reduce, shard, unshard

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
