"""Session-scoped rank pools from ``funcshard.testing``: ``world2.run(fn, *args)`` runs ``fn`` on
every rank of a 2-rank gloo process group and returns the per-rank results."""

import pytest

import funcshard as fs


@pytest.fixture(scope="session")
def world2():
    with fs.testing.Pool(2, timeout=240) as pool:
        yield pool


@pytest.fixture(scope="session")
def world4():
    with fs.testing.Pool(4, timeout=240) as pool:
        yield pool
