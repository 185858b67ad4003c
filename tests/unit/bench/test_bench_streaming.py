"""bench/bench_streaming.py: the stored mode trains a valid run configuration."""
from __future__ import annotations

import argparse

import yaml
from support.bench_scripts import load_bench


def test_streaming_bench_stored_mode_trains_a_valid_configuration(tmp_path, qwen3_target):
    from peagle.run_config import RunConfig

    bench = load_bench("bench_streaming")
    path = bench.run_config(argparse.Namespace(epochs=1), qwen3_target, "s3://b/hs/train", "s3://b/train",
                            tmp_path / "w", None)
    RunConfig.model_validate(yaml.safe_load(path.read_text()))
