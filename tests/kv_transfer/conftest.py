from __future__ import annotations

import pytest

from tests.kv_transfer.harness import release_regions


@pytest.fixture(autouse=True)
def _release_shared_caches():
    """Each test's shared caches: their descriptors closed and unregistered (views stay valid)."""
    yield
    release_regions()
