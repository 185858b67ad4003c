"""The stage commands check their URIs before any work: nothing reaches a real SeaweedFS server (the
URI/key rule itself: tests/unit/storage/test_storage_uri.py)."""
from __future__ import annotations

import json


from peagle.cli import main
from support.seaweed import BUCKET, unique


def _chats(tmp_path):
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}) + "\n" for i in range(4)))
    return src


def test_stage_commands_check_uris_before_any_work(qwen3_target, tmp_path, s3_env, capsys):
    """prepare/extract/train stop at once with exit 2 and 'peagle: error: <argument>: ...'; before the fix
    prepare ran the whole stage, then died with a ValueError traceback (exit 1), or quietly published
    ``//abs`` as ``abs/`` and ``p/a\\nb`` as ``p/ab``; a bucket ``..`` reached the server."""
    run = unique("uri")
    src = _chats(tmp_path)
    bad = [f"s3://{BUCKET}/{run}/../../escape", f"s3://{BUCKET}/{run}/%2e%2e/x", f"s3://{BUCKET}/{run}/a/./b",
           f"s3://{BUCKET}/{run}/a%00b", f"s3://{BUCKET}//{run}", f"s3://{BUCKET}/{run}/a\nb", f"s3://../{run}"]
    for out in bad:
        rc = main(["prepare", "--target", str(qwen3_target), "--sources", str(src), "--out", out,
                   "--set", f"work_dir={tmp_path / 'work'}"])
        err = capsys.readouterr().err
        assert rc == 2, (out, err)
        assert err.startswith("peagle: error: --out: ") and len(err.strip().splitlines()) == 1, err
    client = s3_env.client()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])]  # the whole bucket: the session's server holds other tests' objects
    assert not [k for k in keys if run in k], keys  # nothing written anywhere: not run/, not run/ab, not abs
    assert not (tmp_path / "work").exists()

    assert main(["extract", "--target", str(qwen3_target), "--data", f"s3://{BUCKET}/{run}/%2e%2e",
                 "--set", f"work_dir={tmp_path / 'work'}"]) == 2
    assert capsys.readouterr().err.startswith("peagle: error: --data: ")
    assert main(["extract", "--target", str(qwen3_target), "--out", f"s3://{BUCKET}/{run}//hs",
                 "--set", f"work_dir={tmp_path / 'work'}"]) == 2
    assert capsys.readouterr().err.startswith("peagle: error: --out: ")
    assert main(["train", "--target", str(qwen3_target), "--data", str(tmp_path / "d.safetensors"),
                 "--output", f"s3://{BUCKET}/{run}/ckpt\n", "--set", f"work_dir={tmp_path / 'work'}"]) == 2
    assert capsys.readouterr().err.startswith("peagle: error: train.output (--output): ")
