"""bench/bench_regenerate.py: its configurations are valid regeneration settings; a malformed --set is a usage error."""
from __future__ import annotations

import pytest
from support.bench_scripts import load_bench


def test_regenerate_bench_configurations_are_valid_settings(capsys):
    bench = load_bench("bench_regenerate")
    for overrides in bench.CONFIGS.values():
        bench.regenerate_settings(overrides, max_conversations=8)
    assert bench.parse_set("t4:cpu_threads=4,enforce_eager=false") == ("t4", {"cpu_threads": 4, "enforce_eager": False})
    with pytest.raises(SystemExit) as exc:
        bench.main(["--set", "t4:cpu_threads"])
    assert exc.value.code == 2 and "'cpu_threads' is not key=value" in capsys.readouterr().err
