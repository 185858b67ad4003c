"""Issue #29 follow-ups: the typed pipeline parameters take their bounds from the config keys they set (so
`pipeline submit` refuses `train_epochs=1000000` naming the parameter), and regeneration renders the
chat template within the same time limit as prepare (a template that never finishes is an error naming
the target and the limit, not a hang)."""
from __future__ import annotations

import faulthandler
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from peagle.config import ConfigError
from peagle.data.errors import PrepareError, TemplateTimeout
from peagle.pipeline.__main__ import main as pipeline_main
from peagle.pipeline.params import COVERAGE, PipelineParams, check_arguments
from peagle.run_config import RunConfig

# ---- 1. typed parameters: the schema's bounds ------------------------------------------------------

BOUNDS = ("gt", "ge", "lt", "le")


def _bounds(field) -> dict[str, float]:
    return {b: getattr(m, b) for m in field.metadata for b in BOUNDS if getattr(m, b, None) is not None}


def _schema_field(key: str):
    section, name = key.split(".")
    return RunConfig.model_fields[section].annotation.model_fields[name]


BOUNDED = [c for c in COVERAGE if _bounds(_schema_field(c.key))]


def test_some_covered_keys_are_bounded():
    assert {"train.epochs", "draft.num_depths", "draft.num_layers", "prepare.max_length"} <= {c.key for c in BOUNDED}


def _zero_means_unset(c) -> bool:
    return c.to_config(0) is None  # the parameter's 0 leaves the key unset (num_samples=0: all)


@pytest.mark.parametrize("c", BOUNDED, ids=lambda c: f"{c.param}->{c.key}")
def test_parameter_bounds_are_the_bounds_of_its_config_key(c):
    schema = _bounds(_schema_field(c.key))
    param = _bounds(PipelineParams.model_fields[c.param])
    upper = {b: v for b, v in schema.items() if b in ("lt", "le")}
    assert {b: v for b, v in param.items() if b in ("lt", "le")} == upper
    if _zero_means_unset(c):  # 0 is allowed for "unset"; between it and the key's bound is refused
        assert {b: v for b, v in param.items() if b in ("gt", "ge")} == {"ge": 0}
    else:
        assert param == schema


def _outside(bound: str, value, kind: type):
    step = 1 if kind is int else 0.5
    return {"le": value + step, "lt": value, "ge": value - step, "gt": value}[bound]


@pytest.mark.parametrize("c", BOUNDED, ids=lambda c: f"{c.param}->{c.key}")
def test_a_value_past_a_config_keys_bound_is_refused_naming_the_parameter(c):
    kind = int if PipelineParams.model_fields[c.param].annotation is int else float
    for bound, value in _bounds(_schema_field(c.key)).items():
        bad = _outside(bound, value, kind)
        if _zero_means_unset(c) and bad == 0:
            bad = -1
        with pytest.raises(ConfigError) as info:
            check_arguments({"target": "s3:///m", c.param: bad})
        assert str(info.value).startswith(f"pipeline parameter '{c.param}'"), str(info.value)
        if bound in ("ge", "le"):  # the bound itself is a valid value
            assert check_arguments({"target": "s3:///m", c.param: value})[c.param] == value


def test_a_parameter_between_its_unset_zero_and_the_keys_lower_bound_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"^pipeline parameter 'min_acceptance_length': .*"
                                          r"evaluate\.min_acceptance_length"):
        check_arguments({"target": "s3:///m", "min_acceptance_length": 0.5})
    assert check_arguments({"target": "s3:///m", "min_acceptance_length": 0})["min_acceptance_length"] == 0


def test_submit_refuses_train_epochs_past_the_schema_naming_the_parameter_before_connecting(capsys, tmp_path,
                                                                                          monkeypatch):
    def no_connection(*a, **kw):
        raise AssertionError("connected although a parameter is invalid")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    package = tmp_path / "p.yaml"
    package.write_text("x")
    code = pipeline_main(["submit", "--host", "http://127.0.0.1:1", "--package", str(package),
                          "--param", "target=s3:///m", "--param", "train_epochs=1000000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("peagle: error: pipeline parameter 'train_epochs'") and "1000" in err, err
    assert "Traceback" not in err and "127.0.0.1" not in err and "'config'" not in err, err


# ---- 2. regeneration: the chat template within prepare's time limit -------------------------------

ENDLESS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")


@pytest.fixture(scope="module")
def endless_target(qwen3_target, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("endless") / "target"
    shutil.copytree(qwen3_target, out)  # the model too: vLLM loads it
    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    tok.chat_template = ENDLESS
    tok.save_pretrained(str(out))
    return out


@pytest.fixture
def hang_guard():
    """Kill the test run (with tracebacks) should a render never end: better than hanging the suite."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_regeneration_prompts_stop_on_an_endless_template_naming_the_target_and_limit(endless_target, hang_guard):
    from peagle.data.regenerate import PromptCounter

    count = PromptCounter(_tokenizer(endless_target), time_limit_s=0.5, source=f"target {endless_target}")
    started = time.monotonic()
    with pytest.raises(TemplateTimeout) as info:
        count([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 30
    msg = str(info.value)
    assert f"target {endless_target}" in msg and "0.5 s" in msg and "prepare.template_time_limit_s" in msg


def test_an_endless_template_is_stopped_before_the_regeneration_engine_is_built(endless_target, hang_guard):
    """vLLM renders the template once while it starts, outside the time limit; the probe render ends it first."""
    from peagle.data.regenerate import probe_template

    with pytest.raises(TemplateTimeout) as info:
        probe_template(str(endless_target), 0.5)
    assert f"target {endless_target}" in str(info.value) and "0.5 s" in str(info.value)


def test_regeneration_prompts_are_counted_as_the_template_renders_them(qwen3_target):
    from peagle.data.regenerate import PromptCounter

    tok = _tokenizer(qwen3_target)
    messages = [{"role": "user", "content": "Say hello."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert PromptCounter(tok, time_limit_s=5.0, source="t")(messages) == len(tok(text, add_special_tokens=False)
                                                                              ["input_ids"])
    refusing = _tokenizer(qwen3_target)
    refusing.chat_template = "{{ raise_exception('no system turns') }}"
    assert PromptCounter(refusing, time_limit_s=5.0, source="t")(messages) is None  # ends that conversation


def test_regenerate_takes_prepares_template_time_limit_into_its_child(tmp_path, monkeypatch):
    """The vLLM child gets ``prepare.template_time_limit_s`` and says what stopped it in one line."""
    from peagle.data import regenerate
    from peagle.data.regenerate import RegenerateSettings, run_regenerate

    seen = {}

    def run_module(module, job, **kw):
        seen.update(job=job, **kw)
        raise kw["error"]("stopped")

    monkeypatch.setattr(regenerate.child, "run_module", run_module)
    with pytest.raises(PrepareError):
        run_regenerate(RegenerateSettings(), "/t", tmp_path / "r.jsonl", template_time_limit_s=0.5)
    assert seen["job"]["template_time_limit_s"] == 0.5


def test_regenerate_child_error_is_one_line_not_a_traceback(tmp_path, capsys):
    """A PrepareError in the regeneration child (here: a missing source, raised before any engine starts)
    reaches the caller as its own message, not as the child's traceback."""
    from peagle.cli import main

    missing = tmp_path / "missing.jsonl"
    (tmp_path / "target").mkdir()  # an output inside the target would be refused first
    rc = main(["regenerate", "--target", str(tmp_path / "target"), "--set", f"regenerate.sources=[{missing}]",
               "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("peagle: error: "), err
    assert str(missing) in err[0] and "Traceback" not in err[0]


@pytest.mark.vllm
def test_regenerate_with_an_endless_template_ends_with_exit_2_naming_the_target_and_limit(endless_target, tmp_path,
                                                                                         capsys):
    from peagle.cli import main

    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}) + "\n")
    rc = main(["regenerate", "--target", str(endless_target), "--set", f"regenerate.sources=[{f}]",
               "--set", "prepare.template_time_limit_s=0.5", "--set", "regenerate.max_tokens=4",
               "--set", "regenerate.engine.timeout_s=900",  # a render without end: killed, not a hung test
               "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("peagle: error: "), err
    assert f"target {endless_target}" in err[-1] and "0.5 s" in err[-1] and "template_time_limit_s" in err[-1]
