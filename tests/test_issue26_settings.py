"""Settings checked together (#26): combinations that cannot work are refused, each naming both keys,
by ``RunConfig`` and on every pipeline path (``peagle run``, ``init_run``, ``pipeline submit``)."""
from __future__ import annotations

import pytest
import yaml

from peagle.config import ConfigError, build_config
from peagle.pipeline.params import PipelineParams, check_arguments, config_text, resolve_run
from peagle.run_config import RunConfig, check_trainer_order

STREAMING_BACK_PRESSURE = {"train.data_mode": "streaming", "train.stream.delete_consumed": True,
                           "train.val_fraction": 0.0, "extract.max_sets_ahead": 2}


def both_named(exc: pytest.ExceptionInfo, *keys: str) -> bool:
    return all(k in str(exc.value) for k in keys)


def test_back_pressure_needs_a_deleting_streaming_trainer():
    with pytest.raises(ConfigError) as exc:
        build_config(RunConfig, values={"extract.max_sets_ahead": 2})
    assert both_named(exc, "extract.max_sets_ahead", "train.data_mode")
    with pytest.raises(ConfigError) as exc:
        build_config(RunConfig, values={"extract.max_sets_ahead": 2, "train.data_mode": "streaming"})
    assert both_named(exc, "extract.max_sets_ahead", "train.stream.delete_consumed")


def test_deleting_consumed_sets_needs_no_validation_split():
    with pytest.raises(ConfigError) as exc:
        build_config(RunConfig, values={"train.data_mode": "streaming", "train.stream.delete_consumed": True})
    assert both_named(exc, "train.stream.delete_consumed", "train.val_fraction")


def test_training_beside_the_extraction_needs_the_streaming_trainer():
    stored = RunConfig()
    with pytest.raises(ConfigError) as exc:
        check_trainer_order(stored, trainer_beside_extract=True, runner="this pipeline")
    assert both_named(exc, "profile.train_beside_extract", "train.data_mode")
    check_trainer_order(stored, trainer_beside_extract=False, runner="this pipeline")
    streaming = build_config(RunConfig, values={"train.data_mode": "streaming"})
    check_trainer_order(streaming, trainer_beside_extract=True, runner="this pipeline")
    check_trainer_order(streaming, trainer_beside_extract=False, runner="this pipeline")  # slower, still ends


def test_back_pressure_needs_the_trainer_beside_the_extraction():
    cfg = build_config(RunConfig, values=STREAMING_BACK_PRESSURE)
    with pytest.raises(ConfigError) as exc:
        check_trainer_order(cfg, trainer_beside_extract=False, runner="this pipeline")
    assert both_named(exc, "extract.max_sets_ahead", "profile.train_beside_extract")
    check_trainer_order(cfg, trainer_beside_extract=True, runner="this pipeline")


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


def test_the_compiled_pipeline_hands_the_profile_to_init_run(tmp_path):
    pytest.importorskip("kfp")
    from peagle.pipeline.build import compile_pipeline

    for beside in (False, True):
        prof = tmp_path / f"p-{str(beside).lower()}.yaml"
        prof.write_text(f"name: p-{str(beside).lower()}\ntrain_beside_extract: {str(beside).lower()}\n")
        spec = next(yaml.safe_load_all(compile_pipeline(prof, tmp_path / "out.yaml").read_text()))
        inits = [t for c in spec["components"].values() for t in (c.get("dag") or {}).get("tasks", {}).values()
                 if t["componentRef"]["name"].startswith("comp-init-run")]
        assert inits, "no init_run task"
        for t in inits:
            given = t["inputs"]["parameters"]["train_beside_extract"]["runtimeValue"]["constant"]
            assert given is beside


def test_regenerate_follows_prepare_unless_set():
    """``regenerate.max_conversations`` unset: as many conversations as prepare keeps rows; set, it
    changes nothing else (it used to set ``prepare.max_samples`` too, through one pipeline parameter)."""
    cfg = build_config(RunConfig, values={"prepare.max_samples": 1900})
    assert cfg.regenerate.max_conversations == 1900
    cfg = build_config(RunConfig, values={"prepare.max_samples": 100, "regenerate.max_conversations": 300})
    assert (cfg.prepare.max_samples, cfg.regenerate.max_conversations) == (100, 300)
    assert build_config(RunConfig).regenerate.max_conversations is None


def test_peagle_run_keeps_prepare_when_only_regeneration_is_set():
    from peagle.pipeline.local import embedded
    from peagle.pipeline.local.job import pipeline_arguments, user_settings

    args = pipeline_arguments(user_settings(None, ["regenerate.max_conversations=1900"]))
    assert args["num_samples"] == embedded.PARAMS["num_samples"]
    assert yaml.safe_load(args["config"])["regenerate"]["max_conversations"] == 1900
    run = resolve_run(PipelineParams(**{k: args[k] for k in PipelineParams.model_fields if k in args}),
                      args["config"], "/tmp/r")
    assert (run.config.prepare.max_samples, run.config.regenerate.max_conversations) == (
        embedded.PARAMS["num_samples"], 1900)
