"""The traffic log on real S3 (SeaweedFS): redaction happens before the bytes reach the store.
(The traffic log on a local store: tests/unit/traffic/test_traffic_log.py.)"""
from __future__ import annotations

from peagle.storage import S3Store
from support.seaweed import BUCKET, unique
from support.traffic_records import assert_redacted, secret_record, write_records


def test_redaction_on_the_bytes_of_real_s3(seaweed_server):
    prefix = unique("traffic")
    write_records(S3Store(BUCKET, prefix, seaweed_server.settings()), [secret_record()])
    client = seaweed_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")["Contents"]]
    assert any(k.endswith("/records.jsonl") for k in keys) and any(k.endswith("/_SUCCESS") for k in keys)
    assert_redacted(b"".join(client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys))
