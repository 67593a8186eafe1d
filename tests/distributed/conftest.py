import pytest

from helpers.distributed import RankPool


@pytest.fixture(scope="session")
def _pools():
    pools: list[RankPool] = []
    yield pools
    for pool in pools:
        pool.close()


@pytest.fixture
def rank_pool(_pools):
    """Two gloo ranks, shared by the tests that run functions on several ranks; a fresh pair after a
    test whose failure closed them."""
    if not _pools or _pools[-1].closed:
        _pools.append(RankPool(2))
    return _pools[-1]
