"""Run layout, the typed parameters + config YAML resolution, the embedded-run arguments, the train
worker's launch line, and each parameter's bounds (those of the config key it sets)."""
from __future__ import annotations

import pytest
import yaml

from support.paths import REPO

from peagle.config import ConfigError
from peagle.pipeline.layout import RunLayout, normalize_uri, run_uri
from peagle.pipeline.params import COVERAGE, PipelineParams, check_arguments, config_text, resolve_run
from peagle.run_config import RunConfig


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

    import yaml

    kfp_type = {str: "STRING", int: "NUMBER_INTEGER", float: "NUMBER_DOUBLE", bool: "BOOLEAN"}
    compiled = REPO / "pipelines" / "compiled" / "peagle-default.yaml"
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


# ---- each parameter takes its bounds from the config key it sets -----------------------------------------


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


def test_submitted_arguments_are_the_validated_values():
    from peagle.pipeline.params import check_arguments

    args = check_arguments({"target": "s3:///m", "num_gpus": 2.0, "min_acceptance_length": 2, "run_name": "2024",
                            "regenerate": True, "config": "train: {lr: 0.001}\n"})
    assert args == {"target": "s3:///m", "num_gpus": 2, "min_acceptance_length": 2.0, "run_name": "2024",
                    "regenerate": True, "config": "train: {lr: 0.001}\n"}
    assert type(args["num_gpus"]) is int and type(args["min_acceptance_length"]) is float


# ---- the run's settings against the cluster profile (issue #26) -----------------------------------------


def both_named(exc: pytest.ExceptionInfo, *keys: str) -> bool:
    return all(k in str(exc.value) for k in keys)


def test_init_run_refuses_what_the_profile_cannot_run():
    params = PipelineParams(target="smollm2")
    with pytest.raises(ConfigError) as exc:
        resolve_run(params, "", "/tmp/r", trainer_beside_extract=True)
    assert both_named(exc, "profile.train_beside_extract", "train.data_mode")
    back_pressure = config_text(yaml.safe_load(
        "train: {data_mode: streaming, val_fraction: 0, stream: {delete_consumed: true}}\n"
        "extract: {max_sets_ahead: 2}\n"))
    with pytest.raises(ConfigError) as exc:
        resolve_run(params, back_pressure, "/tmp/r", trainer_beside_extract=False)
    assert both_named(exc, "extract.max_sets_ahead", "profile.train_beside_extract")
    assert resolve_run(params, back_pressure, "/tmp/r", trainer_beside_extract=True).config.extract.max_sets_ahead == 2


def test_submit_checks_the_arguments_against_the_profile():
    with pytest.raises(ConfigError) as exc:
        check_arguments({"target": "smollm2"}, trainer_beside_extract=True)
    assert both_named(exc, "profile.train_beside_extract", "train.data_mode")
