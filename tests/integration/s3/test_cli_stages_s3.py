"""The stage commands chain on the command line through a real S3-compatible store (SeaweedFS): each stage's
output is published in the bucket and the next stage reads it there (on local paths:
tests/unit/test_cli_stages.py)."""
from __future__ import annotations

import json

from peagle.cli import main
from peagle.extract import open_hidden_states
from peagle.model.target import fingerprint
from support.seaweed import BUCKET, unique


def test_prepare_and_extract_through_s3(qwen3_target, tmp_path, monkeypatch, seaweed_server, capsys):
    """Stage outputs land in a real S3-compatible store (SeaweedFS) and the next stage reads them there."""
    from peagle.storage import is_complete, open_store

    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"Name {i} colours."}, {"role": "assistant", "content": "Red and blue."}]}) + "\n"
        for i in range(6)))
    root = f"s3://{BUCKET}/{unique('run')}"
    assert main(["prepare", "--target", str(qwen3_target), "--sources", str(src), "--validation-fraction", "0",
                 "--out", f"{root}/data", "--no-dedup"]) == 0
    assert is_complete(open_store(f"{root}/data"), "")
    assert main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", f"{root}/data",
                 "--out", f"{root}/hs", "--splits", "train", "--samples-per-shard", "2"]) == 0
    ds = open_hidden_states(f"{root}/hs/train", expect_hidden_size=256, expect_fingerprint=fingerprint(qwen3_target))
    assert ds.num_samples == 6 and len(ds.shard_names) == 3
    assert sum(s.input_ids.shape[0] for s in ds) == ds.num_tokens
    # rerun: every shard set is already published in the bucket, nothing is recomputed or republished
    hs = open_store(f"{root}/hs")

    def published() -> dict[str, bytes]:  # every object with its bytes (manifests carry their creation time)
        return {key: hs.get_bytes(key) for key in hs.list()}

    before = published()
    assert main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", f"{root}/data",
                 "--out", f"{root}/hs", "--splits", "train", "--samples-per-shard", "2"]) == 0
    assert published() == before
