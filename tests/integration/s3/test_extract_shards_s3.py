"""Extraction output on a real S3 store (SeaweedFS): a shard set killed midway is redone, a tampered shard
is named by its key on read. The same checks on a local directory: tests/unit/extract/test_extract_shards.py."""
from __future__ import annotations

import pytest

from support.extract_shards import (check_a_shard_set_killed_midway_is_redone,
                                    check_a_tampered_shard_fails_on_read_naming_its_key)
from support.seaweed import BUCKET, unique


@pytest.fixture
def out_uri(seaweed_server, monkeypatch):
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{BUCKET}/{unique('hs')}"


def test_a_shard_set_killed_midway_is_redone_and_complete_ones_are_skipped(qwen3_target, out_uri, monkeypatch):
    check_a_shard_set_killed_midway_is_redone(qwen3_target, out_uri, monkeypatch)


def test_a_tampered_shard_fails_on_read_naming_its_key(qwen3_target, out_uri):
    check_a_tampered_shard_fails_on_read_naming_its_key(qwen3_target, out_uri)
