"""Run layout, the typed parameters + config YAML resolution, the embedded-run arguments, the train
worker's launch line and submission (against a fake kfp client: no pipeline server here)."""
from __future__ import annotations

import pytest

from peagle.config import ConfigError
from peagle.pipeline.layout import RunLayout, normalize_uri, run_uri
from peagle.pipeline.params import PipelineParams, config_text, resolve_run


def params(**kw) -> PipelineParams:
    return PipelineParams(**{"target": "smollm2", **kw})


def test_layout_is_fixed_per_run():
    assert run_uri("s3:///peagle/runs", "", "3f1c") == "s3:///peagle/runs/3f1c"
    assert run_uri("s3://b/x/", "mine", "3f1c") == "s3://b/x/mine"
    assert run_uri("file:///tmp/r", "a", "") == "/tmp/r/a"
    assert normalize_uri("file:///tmp/a%20b/") == "/tmp/a b"
    lay = RunLayout("s3://b/runs/r1")
    assert lay.remote and lay.target == "s3://b/runs/r1/models/target" and lay.draft == "s3://b/runs/r1/models/draft"
    assert lay.hidden_states("validation") == "s3://b/runs/r1/hidden_states/validation"
    assert RunLayout("/tmp/r").data == "/tmp/r/data" and not RunLayout("/tmp/r").remote
    for bad in ("", "a/b", "../x", "x" * 200):
        with pytest.raises(ValueError):
            run_uri("/tmp", bad, "")
    with pytest.raises(ValueError):
        RunLayout("/tmp/r").hidden_states("test")


def test_typed_parameters_fill_the_config():
    run = resolve_run(params(data_source="a.jsonl, hf:x", num_samples=0, num_speculative_tokens=6,
                             train_max_steps=100, min_acceptance_length=0.0),
                      config_text({"train": {"lr": 3e-4}, "evaluate": {"max_tokens": 32}}), "/tmp/r")
    c = run.config
    assert c.prepare.sources == ["a.jsonl", "hf:x"] == c.regenerate.sources
    assert c.prepare.max_samples is None and c.regenerate.max_conversations is None
    assert c.draft.num_depths == 6 and c.train.max_steps == 100 and c.train.lr == 3e-4
    assert run.config.evaluate.min_acceptance_length is None and run.config.evaluate.max_tokens == 32
    same = resolve_run(params(max_length=512), "prepare: {max_length: 512}", "/tmp/r")  # agreeing is fine
    assert same.config.prepare.max_length == 512


@pytest.mark.parametrize("config, match", [
    ("prepare: {max_length: 512}", "'prepare.max_length'.*max_length"),
    ("train: {data: /x}", "train.data"),
    ("work_dir: /x", "work_dir"),
    ("evaluate: {draft: /x}", "evaluate.draft"),
    ("trian: {lr: 1}", "trian"),
    ("evaluate: {max_tokenz: 3}", "evaluate.max_tokenz"),
    ("- a list", "mapping"),
    ("a: [", "not valid YAML"),
    ("train: {global_batch_rows: 3}", "not divisible"),
])
def test_bad_config_is_refused_naming_the_key(config, match):
    with pytest.raises(ConfigError, match=match):
        resolve_run(params(num_gpus=2), config, "/tmp/r")


def test_embedded_arguments_move_covered_keys_to_parameters():
    from peagle.pipeline.local.job import pipeline_arguments, user_settings

    user = user_settings(None, ["draft.num_depths=3", "prepare.max_samples=50", "train.lr=0.01",
                                "evaluate.max_tokens=16", "target.path=/models/t", "work_dir=/tmp/w"])
    args = pipeline_arguments(user, prompts=1, regenerate=True)
    assert (args["num_speculative_tokens"], args["num_samples"], args["target"], args["regenerate"]) == (
        3, 50, "/models/t", True)
    run = resolve_run(PipelineParams(**{k: v for k, v in args.items() if k in PipelineParams.model_fields}),
                      args["config"], "/tmp/r")
    assert run.config.train.lr == 0.01 and run.config.draft.draft_vocab_size == 8192
    ev = run.config.evaluate
    assert ev.num_speculative_tokens == [3] and ev.max_tokens == 16 and ev.prompts_per_category == 1
    assert pipeline_arguments(user, regenerate=False)["regenerate"] is False  # peagle run --no-regenerate
    with pytest.raises(ConfigError):
        user_settings(None, ["evaluate.nope=1"])


def test_train_worker_launch_line():
    import sys

    from peagle.pipeline.train_worker import command

    assert command("c.yaml", 1, {}) == [sys.executable, "-m", "peagle.train", "--config", "c.yaml"]
    assert command("c.yaml", 4, {})[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc-per-node=4"]
    multi = command("c.yaml", 8, {"PET_NNODES": "4"})
    assert "--standalone" not in multi and multi[2] == "torch.distributed.run"


def test_submit_uses_the_client_and_env(tmp_path, monkeypatch):
    from peagle.pipeline.submit import SubmitError, make_client, submit

    class FakeClient:  # no pipeline server on these machines
        _uihost = "https://ds-pipeline.example"

        def create_run_from_pipeline_package(self, path, arguments, run_name, experiment_name, namespace,
                                             enable_caching):
            self.args = (path, arguments, run_name, experiment_name, namespace, enable_caching)
            return type("Run", (), {"run_id": "r-123"})()

    pkg = tmp_path / "p.yaml"
    pkg.write_text("x")
    client = FakeClient()
    done = submit(pkg, {"target": "s3:///m"}, client=client, experiment="e", run_name="n")
    assert done.run_id == "r-123" and done.url == "https://ds-pipeline.example/#/runs/details/r-123"
    assert client.args[1] == {"target": "s3:///m"} and client.args[5] is False
    for name in ("KF_PIPELINES_ENDPOINT", "KFP_HOST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SubmitError, match="KF_PIPELINES_ENDPOINT"):
        make_client()
    with pytest.raises(SubmitError, match="not found"):
        submit(tmp_path / "missing.yaml", {}, client=client)


# ---- one definition of the pipeline parameters: everything else derives from it, and drift fails here


def _definition() -> dict[str, tuple[type, object, str]]:
    """name -> (KFP Python type, default or REQUIRED, description), from PipelineParams + RunPlacement."""
    import typing

    from peagle.pipeline.params import PIPELINE_MODELS

    out = {}
    for model in PIPELINE_MODELS:
        for name, f in model.model_fields.items():
            t = f.annotation
            t = type(typing.get_args(t)[0]) if typing.get_origin(t) is typing.Literal else t
            out[name] = (t, "REQUIRED" if f.is_required() else f.default, f.description)
    return out


def test_the_compiled_pipeline_signature_derives_from_the_definition():
    """The IR's run-form parameters: names, types, defaults and descriptions equal the definition."""
    from pathlib import Path

    import yaml

    kfp_type = {str: "STRING", int: "NUMBER_INTEGER", float: "NUMBER_DOUBLE", bool: "BOOLEAN"}
    compiled = Path(__file__).resolve().parents[1] / "pipelines" / "compiled" / "peagle-default.yaml"
    spec = next(yaml.safe_load_all(compiled.read_text()))
    ir = spec["root"]["inputDefinitions"]["parameters"]
    definition = _definition()
    assert sorted(ir) == sorted(definition)
    for name, (t, default, description) in definition.items():
        p = ir[name]
        assert p["parameterType"] == kfp_type[t], name
        assert p.get("description") == description, name
        if default == "REQUIRED":
            assert "defaultValue" not in p and not p.get("isOptional"), name
        else:
            assert p["defaultValue"] == default and type(default)(p["defaultValue"]) == default, name


def test_the_pipeline_function_and_init_run_component_derive_from_the_definition():
    import inspect
    from pathlib import Path

    from peagle.pipeline.build import init_run_component_path, pipeline_for
    from peagle.pipeline.params import PipelineParams, init_run_component_source, pipeline_signature

    assert init_run_component_path().read_text() == init_run_component_source(), (
        "components/init_run.py is stale: run `peagle pipeline compile` (it regenerates the component)")
    definition = _definition()
    sig = pipeline_signature()
    assert [(n, p.annotation, p.default if p.default is not inspect.Parameter.empty else "REQUIRED")
            for n, p in sig.parameters.items()] == [(n, t, d) for n, (t, d, _) in definition.items()]
    pipeline = pipeline_for("default")
    assert sorted(pipeline.component_spec.inputs) == sorted(definition)

    from components.init_run import init_run

    params = inspect.signature(init_run).parameters
    typed = {n: p.annotation for n, p in params.items()
             if n not in ("output_root", "run_name", "job_id", "config", "target_model", "data_connection",
                          "train_beside_extract")}  # the last: the profile's, a constant of the compiled pipeline
    assert typed == {n: definition[n][0] for n in PipelineParams.model_fields}
    assert Path(inspect.getsourcefile(init_run)).resolve() == init_run_component_path().resolve()


def test_embedded_arguments_are_complete_validated_parameters():
    from peagle.pipeline.local import embedded
    from peagle.pipeline.params import PipelineParams

    assert set(embedded.PARAMS) == set(PipelineParams.model_fields)
    assert PipelineParams(**embedded.PARAMS).model_dump(mode="json") == embedded.PARAMS


def test_coverage_maps_both_ways_and_names_real_keys():
    """Every covered config key exists in RunConfig, every covering name is a typed parameter, and
    parameter -> config -> parameter returns the value (what `peagle run --set key=...` relies on)."""
    from peagle.config import build_config
    from peagle.pipeline.local import embedded
    from peagle.pipeline.params import COVERAGE, PipelineParams
    from peagle.run_config import RunConfig

    defaults = PipelineParams(target="smollm2")
    for c in COVERAGE:
        assert c.param in PipelineParams.model_fields, c
        for value in (getattr(defaults, c.param), embedded.PARAMS[c.param]):
            as_config = c.to_config(value)
            assert c.to_param(as_config) == value, c
            section, name = c.key.split(".")
            cfg = build_config(RunConfig, values={c.key: as_config})
            assert getattr(getattr(cfg, section), name) == as_config, c


def test_two_keys_of_one_parameter_must_agree():
    from peagle.pipeline.local.job import pipeline_arguments, user_settings

    user = user_settings(None, ["prepare.sources=[a.jsonl]", "regenerate.sources=[b.jsonl]"])
    with pytest.raises(ConfigError, match="'prepare.sources' and 'regenerate.sources'"):
        pipeline_arguments(user)
    same = user_settings(None, ["prepare.sources=[a.jsonl]", "regenerate.sources=[a.jsonl]"])
    assert pipeline_arguments(same)["data_source"] == "a.jsonl"
