"""Session-scoped rank pools from ``funcshard.testing``: ``world2.run(fn, *args)`` runs ``fn`` on
every rank of a 2-rank gloo process group and returns the per-rank results. ``worlds(n)`` gives
the pool of ``n`` ranks; each size is started once, on first use, and shared by all fixtures."""

import pytest

import funcshard as fs

_pools: dict[int, fs.testing.Pool] = {}


def _pool(size: int) -> fs.testing.Pool:
    if size not in _pools:
        _pools[size] = fs.testing.Pool(size, timeout=240)
    return _pools[size]


@pytest.fixture(scope="session")
def worlds():
    return _pool


@pytest.fixture(scope="session")
def world1():
    return _pool(1)


@pytest.fixture(scope="session")
def world2():
    return _pool(2)


@pytest.fixture(scope="session")
def world4():
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
