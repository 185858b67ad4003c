"""bench/bench_extract.py: its configurations are valid extraction settings; an unknown one is a usage error."""
from __future__ import annotations

import pytest
from support.bench_scripts import load_bench


def test_extract_bench_configurations_are_valid_settings(capsys):
    bench = load_bench("bench_extract")
    for label in bench.CONFIGS:
        bench.extract_settings(label)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--configs", "hf,nope"])
    assert exc.value.code == 2 and "unknown config 'nope'" in capsys.readouterr().err
