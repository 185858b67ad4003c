"""Engine settings (peagle.engine.settings, peagle.engine.llm): one ``EngineSettings`` shared by regenerate,
extract and evaluate (issue 26, item 3).

* The embedded run's engines get the very arguments they got before the settings moved
  (``tests/data/issue26_engine_kwargs.json``: computed with the code at the issue's start, on a CPU
  and on a GPU machine as :func:`peagle.engine.llm.cpu_only` says; one change on purpose since: the
  evaluate engines' ``max_num_seqs`` 16, the top of the embedded speed ladder, issue 37);
* a stage's own engine defaults survive setting another engine key of that stage;
* the old keys fail, naming themselves; "eager on CPU, compiled on GPU" is decided in one function;
* one result and one error marker for every engine child.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from peagle.config import ConfigError, build_config
from peagle.engine import child, llm as engine
from peagle.engine.settings import EngineSettings
from peagle.pipeline.local import embedded
from peagle.run_config import RunConfig
from support.paths import TEST_DATA

BEFORE = json.loads((TEST_DATA / "issue26_engine_kwargs.json").read_text())
SRC = Path(engine.__file__).resolve().parents[1]


class Captured(Exception):
    pass


def _capture(kwargs, settings):
    raise Captured({"kwargs": kwargs, "in_process": settings.in_process, "kv_cache_gib": settings.cpu_kv_cache_gib})


def _resolved(monkeypatch, cpu: bool) -> dict[str, dict]:
    """What each stage of the embedded run hands ``vllm.LLM`` (and the engine environment), by stage."""
    from peagle.data.regenerate import VllmGenerator
    from peagle.data.settings import RegenerateSettings
    from peagle.evaluate import live, vllm_job
    from peagle.evaluate.settings import EvaluateSettings
    from peagle.extract.settings import ExtractSettings, LayerIds
    from peagle.extract.vllm_backend import VllmHiddenStatesExtractor

    monkeypatch.setattr(engine, "build_llm", _capture)
    monkeypatch.setattr(engine, "cpu_only", lambda: cpu)
    monkeypatch.setattr(engine, "native_bf16", lambda: True)  # the snapshot's CPU (AVX512-BF16)
    from peagle.data import regenerate
    monkeypatch.setattr(regenerate, "probe_template", lambda target, limit: None)  # '/t' has no tokenizer
    dev, config, out = "cpu" if cpu else "gpu", embedded.CONFIG, {}
    with pytest.raises(Captured) as got:
        VllmHiddenStatesExtractor("/t", LayerIds((2, 15, 27), 30), "bfloat16",
                                  ExtractSettings.model_validate(config["extract"]), 257, "/scratch")
    out[f"extract/{dev}"] = got.value.args[0]
    with pytest.raises(Captured) as got:
        VllmGenerator(RegenerateSettings.model_validate(config["regenerate"]), "/t")
    out[f"regenerate/{dev}"] = got.value.args[0]
    jobs = live.offline_api_jobs(EvaluateSettings.model_validate(config["evaluate"]), "/t", "/d", [2, 4], [])
    for k, purpose, job in jobs:
        job = json.loads(json.dumps(job))  # what the child reads
        with pytest.raises(Captured) as got:
            vllm_job._run(job)
        out[f"evaluate/{dev}/{k}/{purpose}/{job['dtype']}"] = got.value.args[0]
    return out


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "gpu"])
def test_the_embedded_runs_engines_get_the_arguments_they_got_before(monkeypatch, cpu):
    dev = "cpu" if cpu else "gpu"
    before = {k: v for k, v in BEFORE.items() if f"/{dev}" in k}
    assert _resolved(monkeypatch, cpu) == before


def test_the_embedded_config_names_the_engine_keys_under_engine():
    cfg = RunConfig.model_validate(embedded.CONFIG)
    assert (cfg.extract.engine.max_num_seqs, cfg.extract.engine.cpu_kv_cache_gib) == (32, 2)
    assert (cfg.regenerate.conversations_per_batch, cfg.regenerate.engine.in_process) == (512, True)
    assert (cfg.evaluate.engine.max_model_len, cfg.evaluate.engine.cpu_kv_cache_gib) == (1024, 2)
    # a user's engine key joins the embedded engine section instead of replacing it
    merged = embedded.merged_config({"extract": {"engine": {"max_num_seqs": 4}}})
    assert merged["extract"]["engine"] == {"max_num_seqs": 4, "cpu_kv_cache_gib": 2}
    assert merged["extract"]["samples_per_shard"] == 128
    merged["extract"]["engine"].clear()  # callers edit what they get, never the embedded default
    assert embedded.CONFIG["extract"]["engine"] == {"max_num_seqs": 32, "cpu_kv_cache_gib": 2}


def test_a_stages_engine_defaults_survive_setting_another_engine_key():
    cfg = build_config(RunConfig, overrides=["extract.engine.max_num_seqs=4", "evaluate.engine.cpu_threads=2",
                                             "regenerate.engine.cpu_threads=2"])
    ex, ev, rg = cfg.extract.engine, cfg.evaluate.engine, cfg.regenerate.engine
    assert (ex.max_num_seqs, ex.enforce_eager, ex.enable_prefix_caching, ex.gpu_memory_utilization) == (4, True, False,
                                                                                                         0.9)
    assert (ev.max_num_seqs, ev.cpu_kv_cache_gib, ev.timeout_s, ev.cpu_threads) == (64, 4, 7200.0, 2)
    assert (rg.max_num_seqs, rg.enforce_eager, rg.cpu_kv_cache_gib) == (None, None, 1)


@pytest.mark.parametrize("key", [
    "extract.max_model_len", "extract.cpu_kv_cache_gib", "extract.engine_timeout_s", "extract.cpu_threads",
    "regenerate.batch_size", "regenerate.max_num_seqs", "regenerate.engine_in_process", "regenerate.enforce_eager",
    "evaluate.max_num_seqs", "evaluate.enforce_eager", "evaluate.timeout_s", "evaluate.engine_in_process",
])
def test_the_old_keys_fail_naming_themselves(key):
    with pytest.raises(ConfigError, match=re.escape(key.split(".")[1])):
        build_config(RunConfig, overrides=[f"{key}=1"])


def test_eager_on_cpu_compiled_on_gpu_is_decided_once(monkeypatch):
    for cpu in (True, False):
        monkeypatch.setattr(engine, "cpu_only", lambda cpu=cpu: cpu)
        assert engine.engine_kwargs(EngineSettings(), "/t", seed=0)["enforce_eager"] is cpu
        assert engine.engine_kwargs(EngineSettings(enforce_eager=True), "/t", seed=0)["enforce_eager"] is True
    kw = engine.engine_kwargs(EngineSettings(), "/t", seed=3)
    assert kw == {"model": "/t", "max_model_len": None, "enforce_eager": False, "seed": 3, "trust_remote_code": False}
    assert engine.engine_kwargs(EngineSettings(in_process=True), "/t", seed=0, log_stats=True, dtype="float32") == {
        **kw, "seed": 0, "distributed_executor_backend": "uni", "disable_log_stats": False, "dtype": "float32"}


@pytest.mark.parametrize("cpu, bf16, asked, runs", [
    (True, False, None, "float32"), (True, False, "auto", "float32"),  # emulated bf16: 4x slower measured
    (True, False, "bfloat16", "bfloat16"), (True, False, "float16", "float16"),  # asked for: as asked
    (True, True, "auto", "auto"), (True, True, None, None), (False, False, "auto", "auto"), (False, False, None, None),
])
def test_auto_runs_in_float32_on_a_cpu_without_native_bfloat16(monkeypatch, cpu, bf16, asked, runs):
    monkeypatch.setattr(engine, "cpu_only", lambda: cpu)
    monkeypatch.setattr(engine, "native_bf16", lambda: bf16)
    extra = {} if asked is None else {"dtype": asked}
    assert engine.engine_kwargs(EngineSettings(), "/t", seed=0, **extra).get("dtype") == runs


def test_one_engine_kwargs_and_one_pair_of_child_markers():
    sources = {p: p.read_text() for p in SRC.rglob("*.py")}
    assert [p.relative_to(SRC).as_posix() for p, t in sources.items() if "def engine_kwargs" in t] == ["engine/llm.py"]
    marked = sorted(p.relative_to(SRC).as_posix() for p, t in sources.items()
                    if re.search(r'"PEAGLE_\w*(RESULT|ERROR) "', t))
    assert marked == ["engine/child.py"]
    assert child.RESULT_MARKER != child.ERROR_MARKER


def test_the_engine_settings_module_depends_on_the_config_only():
    text = (SRC / "engine" / "settings.py").read_text()
    imports = re.findall(r"^\s*(?:from|import) (\S+)", text, flags=re.M)
    assert {i for i in imports if i.startswith(".") or i.startswith("peagle")} == {"..config"}


def test_an_in_process_extraction_engine_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"extract\.engine\.in_process: .*deadlocks"):
        build_config(RunConfig, overrides=["extract.engine.in_process=true"])
