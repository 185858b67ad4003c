"""S3Store.get_range against a scripted client (no server): what S3 answers that SeaweedFS does not -- a
416 for a range past the end, an endpoint that ignores the Range header. The shared contract of ranged
reads runs over file:// and a real SeaweedFS s3:// (tests/support/store_contract.py)."""
from __future__ import annotations

import io

import pytest
from botocore.exceptions import ClientError

from peagle.storage import S3Settings, S3Store, StorageError
from support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY
from support.store_contract import FAST

DATA = bytes(range(256)) * 4


class ScriptedClient:
    """get_object as an S3 endpoint would answer it: ``honours_range`` or not; records each request."""

    def __init__(self, honours_range: bool = True):
        self.honours_range = honours_range
        self.requests: list[dict] = []

    def get_object(self, **kw):
        self.requests.append(kw)
        if not self.honours_range:
            return {"Body": io.BytesIO(DATA)}
        first, last = (int(x) for x in kw["Range"].removeprefix("bytes=").split("-"))
        if first >= len(DATA):
            raise ClientError({"Error": {"Code": "InvalidRange"}, "ResponseMetadata": {"HTTPStatusCode": 416}},
                              "GetObject")
        last = min(last, len(DATA) - 1)
        return {"Body": io.BytesIO(DATA[first:last + 1]), "ContentRange": f"bytes {first}-{last}/{len(DATA)}"}


def _store(client: ScriptedClient) -> S3Store:
    settings = S3Settings.from_env({"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                                    "AWS_SECRET_ACCESS_KEY": SECRET_KEY}, retry=FAST)
    return S3Store(BUCKET, "models/t", settings, client=client)


def test_range_request_and_416_past_the_end():
    client = ScriptedClient()
    store = _store(client)
    assert store.get_range("model.safetensors", 8, 100) == DATA[8:108]
    assert client.requests[-1] == {"Bucket": BUCKET, "Key": "models/t/model.safetensors", "Range": "bytes=8-107"}
    assert store.get_range("model.safetensors", len(DATA), 8) == b""  # 416 InvalidRange: nothing, no error


def test_an_endpoint_that_ignores_range():
    client = ScriptedClient(honours_range=False)
    store = _store(client)
    assert store.get_range("model.safetensors", 0, 8) == DATA[:8]  # from 0 the whole object's first bytes are right
    with pytest.raises(StorageError, match="get_range s3://peagle-test/models/t/model.safetensors.*ignored the "
                                           "requested range"):
        store.get_range("model.safetensors", 8, 100)
    assert len(client.requests) == 2  # not retried: asking again gets the same answer
