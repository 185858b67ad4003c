"""Every StoreContract test (tests/support/store_contract.py) over a real SeaweedFS s3:// (file://:
tests/unit/storage/test_storage.py)."""
from __future__ import annotations

import pytest

from peagle.storage import S3Store
from support.seaweed import BUCKET, unique
from support.store_contract import StoreContract


@pytest.fixture
def store(seaweed_server):
    return S3Store(BUCKET, unique("beh"), seaweed_server.settings())


class TestS3Store(StoreContract):
    """The Store interface and publication over s3://."""
