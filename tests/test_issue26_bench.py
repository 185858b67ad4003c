"""bench/ on one harness (bench/harness.py): its spec parser, table and machine banner, and every bench's
cheapest mode (argument parsing, spec parsing, the configurations it would run), so no bench can rot
unnoticed. The benches' real runs have their own tests (test_bench_*.py, test_gpu_check.py) or none:
they print figures, they do not assert them."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import yaml
from bench_scripts import BENCH, SCRIPTS, load_bench

harness = load_bench("harness")


# ---- the harness --------------------------------------------------------------------------------

def test_a_spec_is_a_name_and_its_keys_in_order():
    assert harness.parse_spec("n:b=2, a = x,,", "--set") == ("n", {"b": "2", "a": "x"})
    assert harness.parse_spec("bare", "--point", dotted=True) == ("bare", {})
    assert harness.parse_spec("v:train.lr=1e-3,draft.num_layers=2", "--variant", sections=("draft", "train")) == \
        ("v", {"train.lr": "1e-3", "draft.num_layers": "2"})


@pytest.mark.parametrize("spec, kwargs, message", [
    ("", {}, "use name[:key=value,...]"),
    (":a=1", {}, "use name"),
    ("n", {"body_required": True}, "use name:key=value[,key=value]"),
    ("n:a", {}, "'a' is not key=value"),
    ("n:a=1", {"dotted": True}, "'a=1' is not section.key=value"),
    ("n:model.x=1", {"sections": ("draft", "train")}, "is not draft.<key>=<value>, train.<key>=<value>"),
])
def test_a_malformed_spec_names_the_option_and_the_form(spec, kwargs, message):
    with pytest.raises(ValueError) as exc:
        harness.parse_spec(spec, "--opt", **kwargs)
    assert str(exc.value).startswith(f"--opt {spec!r}: ") and message in str(exc.value)


def test_values_are_yaml_scalars_with_exponents_as_floats():
    assert [harness.parse_value(v) for v in ("2", "1e-3", "true", "false", "null", "fp8")] == \
        [2, 1e-3, True, False, None, "fp8"]


def test_choose_keeps_the_given_order_and_refuses_unknown_names():
    assert list(harness.choose("b, a,", {"a": 1, "b": 2}, "config")) == ["b", "a"]
    with pytest.raises(ValueError, match="unknown config 'c'; choose from a, b"):
        harness.choose("a,c", {"a": 1, "b": 2}, "config")


def test_one_table_format():
    text = harness.format_table(["name", "n", "note", ""], [["alpha", "1,024", "x y", ""], ["b", "7", "", ""]])
    assert text.splitlines() == ["name       n  note",
                                 "-----  -----  ----",
                                 "alpha  1,024  x y",
                                 "b          7"]  # numbers right-aligned; the empty last column left out


def test_the_banner_names_the_cpu_the_software_and_the_load():
    import torch

    from peagle.cpu_features import cpu_model

    lines = harness.banner("0.10/0.20/0.30").splitlines()
    assert len(lines) == 3 and all(line.startswith("machine: ") for line in lines)
    assert cpu_model() in lines[0] and "cores" in lines[0] and "amx state" in lines[0]
    assert f"torch {torch.__version__}" in lines[1] and "vllm " in lines[1] and "gpu " in lines[1]
    assert lines[2].startswith("machine: load average (1/5/15 min) at start 0.10/0.20/0.30; at end ")


def test_no_bench_edits_sys_path_or_imports_the_tests():
    for path in BENCH.glob("*.py"):
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, path.name
        assert "from tiny import" not in text and '"src"' not in text, path.name


# ---- every bench: its arguments, and the cheapest mode it has -----------------------------------

@pytest.mark.parametrize("name", SCRIPTS)
def test_every_bench_parses_its_arguments(name, capsys):
    with pytest.raises(SystemExit) as exc:
        load_bench(name).main(["--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: ")


def test_a_bench_runs_as_a_script_with_the_harness_beside_it():
    r = subprocess.run([sys.executable, str(BENCH / "bench_budget.py"), "--point", "n:epochs=2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'epochs=2' is not section.key=value" in r.stderr, r.stderr


def test_extract_bench_configurations_are_valid_settings(capsys):
    bench = load_bench("bench_extract")
    for label in bench.CONFIGS:
        bench.extract_settings(label)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--configs", "hf,nope"])
    assert exc.value.code == 2 and "unknown config 'nope'" in capsys.readouterr().err


def test_regenerate_bench_configurations_are_valid_settings(capsys):
    bench = load_bench("bench_regenerate")
    for overrides in bench.CONFIGS.values():
        bench.regenerate_settings(overrides, max_conversations=8)
    assert bench.parse_set("t4:cpu_threads=4,enforce_eager=false") == ("t4", {"cpu_threads": 4, "enforce_eager": False})
    with pytest.raises(SystemExit) as exc:
        bench.main(["--set", "t4:cpu_threads"])
    assert exc.value.code == 2 and "'cpu_threads' is not key=value" in capsys.readouterr().err


def test_pipeline_bench_tiny_run_is_built_through_the_package(tmp_path):
    arguments = load_bench("bench_pipeline").tiny_arguments(tmp_path)
    assert (tmp_path / "tiny-target" / "config.json").is_file() and arguments["target"].endswith("tiny-target")
    assert yaml.safe_load(arguments["config"])["extract"]["backend"] == "hf"


def test_streaming_bench_stored_mode_trains_a_valid_configuration(tmp_path, qwen3_target):
    from peagle.run_config import RunConfig

    bench = load_bench("bench_streaming")
    path = bench.run_config(argparse.Namespace(epochs=1), qwen3_target, "s3://b/hs/train", "s3://b/train",
                            tmp_path / "w", None)
    RunConfig.model_validate(yaml.safe_load(path.read_text()))
