"""The pure transforms: :func:`shard`, :func:`unshard` and :func:`reduce`."""

from ._reduce import reduce
from ._shard import shard
from ._unshard import unshard

__all__ = ["reduce", "shard", "unshard"]
