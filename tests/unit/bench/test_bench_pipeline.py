"""bench/bench_pipeline.py: the tiny run's arguments are built through the package."""
from __future__ import annotations

import yaml
from support.bench_scripts import load_bench


def test_pipeline_bench_tiny_run_is_built_through_the_package(tmp_path):
    arguments = load_bench("bench_pipeline").tiny_arguments(tmp_path)
    assert (tmp_path / "tiny-target" / "config.json").is_file() and arguments["target"].endswith("tiny-target")
    assert yaml.safe_load(arguments["config"])["extract"]["backend"] == "hf"
