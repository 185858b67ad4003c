"""bench/ on one harness (bench/harness.py): its spec parser, table and machine banner; every bench parses
its arguments and runs as a script with the harness beside it, so no bench can rot unnoticed. Each bench's
cheapest mode is tested in its own tests/unit/bench/test_bench_<name>.py; the real runs print figures, they
do not assert them."""
from __future__ import annotations

import subprocess
import sys

import pytest
from support.bench_scripts import BENCH, SCRIPTS, load_bench

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
