"""The typed run configuration: YAML, overrides, CLI flags, and errors that name the key."""
from __future__ import annotations

import argparse

import pytest

from peagle import config as C
from peagle.run_config import RunConfig


def test_yaml_then_override_then_flag_precedence(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("draft:\n  num_layers: 3\n  num_depths: 6\ntarget:\n  path: /models/t\n")
    parser = argparse.ArgumentParser()
    C.add_flags(parser, C.DraftSettings, "draft")
    ns = parser.parse_args(["--num-depths", "8", "--no-norm-before-residual", "--aux-layer-ids", "1", "5", "9"])
    cfg = C.build_config(RunConfig, f, ["draft.num_layers=4", "draft.num_depths=7"], C.flag_values(ns))
    assert cfg.draft.num_layers == 4  # override beats YAML
    assert cfg.draft.num_depths == 8  # flag beats override
    assert cfg.draft.aux_layer_ids == [1, 5, 9]
    assert cfg.draft.norm_before_residual is False
    assert cfg.target.path == "/models/t"
    assert cfg.target.trust_remote_code is False


def test_unknown_key_in_yaml_is_named(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("draft:\n  num_layer: 3\n")
    with pytest.raises(C.ConfigError, match=r"run\.yaml: unknown key 'draft\.num_layer'"):
        C.build_config(RunConfig, f)


def test_unknown_section_and_mistyped_value_are_named():
    with pytest.raises(C.ConfigError, match="unknown key 'trainer'"):
        C.build_config(RunConfig, overrides=["trainer.lr=1"])
    with pytest.raises(C.ConfigError, match=r"invalid value for 'draft\.num_depths'.*'many'"):
        C.build_config(RunConfig, overrides=["draft.num_depths=many"])
    with pytest.raises(C.ConfigError, match=r"'draft\.arch'"):
        C.build_config(RunConfig, overrides=["draft.arch=mistral"])
    with pytest.raises(C.ConfigError, match=r"'draft\.aux_layer_ids'.*exactly 3"):
        C.build_config(RunConfig, overrides=["draft.aux_layer_ids=[1, 2]"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(C.ConfigError, match="section.key=value"):
        C.parse_override("draft.num_layers")
    with pytest.raises(C.ConfigError, match="not found"):
        C.build_config(RunConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(C.ConfigError, match="top level must be a mapping"):
        C.build_config(RunConfig, bad)


def test_every_draft_field_has_a_flag():
    parser = argparse.ArgumentParser()
    C.add_flags(parser, C.DraftSettings, "draft")
    flags = {a.dest for a in parser._actions}
    assert {f"cfg__draft__{name}" for name in C.DraftSettings.model_fields} <= flags


def test_a_nested_section_gets_prefixed_flags():
    from peagle.train.settings import StreamSettings, TrainSettings

    parser = argparse.ArgumentParser()
    C.add_flags(parser, TrainSettings, "train")
    ns = parser.parse_args(["--data-mode", "streaming", "--stream-window-bytes", "1024", "--stream-delete-consumed",
                            "--val-fraction", "0"])
    cfg = C.build_config(RunConfig, None, [], C.flag_values(ns))
    assert cfg.train.data_mode == "streaming" and cfg.train.stream.window_bytes == 1024
    assert cfg.train.stream.delete_consumed is True
    flags = {a.dest for a in parser._actions}
    assert {f"cfg__train__stream.{name}" for name in StreamSettings.model_fields} <= flags
