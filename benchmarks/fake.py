"""A fake process group in one process (the package's ``funcshard._pricing._fake_world``,
re-exported for the benchmarks)."""

from funcshard._pricing._fake_world import _MirrorStore, fake_world

__all__ = ["_MirrorStore", "fake_world"]
