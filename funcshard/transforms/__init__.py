"""Layer 4 of 6, the pure transforms: :func:`shard`, :func:`unshard` and :func:`reduce`
(and ``fs.materialize``, which shards a module built on meta).

They sit under the plans and the scheduler, which record and compose them; they import the
layers below (``_runtime``, ``_trees``, ``_communication``)."""

from ._reduce import reduce
from ._shard import shard
from ._unshard import unshard

__all__ = ["reduce", "shard", "unshard"]
