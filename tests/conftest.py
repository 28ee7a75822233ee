import pytest

from _world import World

_worlds: dict[int, World] = {}


def _world(size: int) -> World:
    if size not in _worlds:
        _worlds[size] = World(size)
    return _worlds[size]


@pytest.fixture(scope="session")
def world1() -> World:
    return _world(1)


@pytest.fixture(scope="session")
def world2() -> World:
    return _world(2)


@pytest.fixture(scope="session")
def world4() -> World:
    return _world(4)


def pytest_sessionfinish(session, exitstatus):
    for w in _worlds.values():
        w.close()
