"""The typed run configuration: YAML, overrides, CLI flags, and errors that name the key; user-supplied YAML
and ``--set`` values (alias bombs, deep nesting, binary files, files that are not configs, NaN/inf, and a
seeded fuzz of the loader): every input either loads or is a ConfigError (exit 2, ``peagle: error:``) with
a short message; never a traceback."""
from __future__ import annotations

import argparse
import os
import random
import typing
from pathlib import Path

import pytest
import yaml

from peagle import config as C
from peagle.cli import main
from peagle.config import ConfigError, build_config
from peagle.pipeline.__main__ import main as pipeline_main
from peagle.pipeline.params import parse_config_text
from peagle.pipeline.profile import ClusterProfile, load_profile
from peagle.run_config import RunConfig
from support.config_fuzz import MAX_MESSAGE, bomb, check, document, set_string


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


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``peagle ARGV`` in-process: (exit code, stdout, stderr). An uncaught exception (a traceback in a real
    process) fails the test where it is raised."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_refused(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, (rc, err[-2000:])
    err = err.strip()
    assert err.startswith("peagle: error: ") and len(err) < MAX_MESSAGE, err[:2000]
    for n in needles:
        assert n in err, err
    return err


# ---------------------------------------------------------------------------------------------- alias bombs


def test_alias_bomb_is_refused_by_every_yaml_reader(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(bomb(6))  # 531,441 strings expanded: the old message quoted them all (megabytes)
    with pytest.raises(ConfigError, match=r"config file .*bomb\.yaml: more than 100000 values") as e:
        build_config(RunConfig, f)
    assert len(str(e.value)) < 300
    f.write_text(bomb(6, under="name: "))
    with pytest.raises(ConfigError, match=r"cluster profile .*bomb\.yaml: more than 100000 values") as e:
        load_profile(f)
    assert len(str(e.value)) < 300
    with pytest.raises(ConfigError, match=r"pipeline parameter 'config': more than 100000 values"):
        parse_config_text(bomb(6))
    wide = "&a [" + ", ".join(["x"] * 200) + "]"  # 200 values, then 999 aliases to it: 200,000
    with pytest.raises(ConfigError, match=r"override 'target.path': more than 100000 values"):
        build_config(RunConfig, overrides=["target.path=[" + ", ".join([wide] + ["*a"] * 999) + "]"])
    with pytest.raises(ConfigError, match=r"more than 1000 aliases"):
        build_config(RunConfig, overrides=["target.path=[&a x" + ", *a" * 1001 + "]"])


def test_alias_bomb_is_refused_by_deploy_values_and_pipeline_submit(tmp_path, capsys):
    from peagle.deploy.cli import main as deploy_main

    f = tmp_path / "bomb.yaml"
    f.write_text(bomb(6, under="extra: "))
    assert deploy_main(["--name", "x", "-f", str(f), "--render-only", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"peagle: error: values file {f}: more than 100000 values") and len(err) < 300, err[:1000]
    assert not (tmp_path / "out").exists()
    assert pipeline_main(["submit", "--package", str(f), "--param", "target=s3:///m/t", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"peagle: error: config file {f}: more than 100000 values") and len(err) < 300, err[:1000]


def test_recursive_and_undefined_aliases():
    for text, match in (("a: &a [*a]", "contains it"), ("a: &a {b: *a}", "contains it"),
                        ("a: *nope", "undefined alias 'nope'")):
        with pytest.raises(ConfigError, match=match):
            parse_config_text(text)
    # a few anchors, as people write them, still load
    data = parse_config_text("base: &b {lr: 0.001}\ntrain: {<<: *b, epochs: 2}\n")
    assert data["train"] == {"lr": 0.001, "epochs": 2}


# ---------------------------------------------------------------------------------------------- size, depth


def test_deep_set_keys_and_values_are_config_errors(tmp_path, capsys):
    from peagle.cli import main

    deep_key = "target.path." + ".".join(["b"] * 10_000) + "=1"
    with pytest.raises(ConfigError, match=r"more than 64 key parts") as e:
        build_config(RunConfig, overrides=[deep_key])
    assert len(str(e.value)) < 200
    deep_value = "target.path=" + "[" * 5000 + "]" * 5000
    with pytest.raises(ConfigError, match=r"override 'target.path': nested deeper than 64 levels"):
        build_config(RunConfig, overrides=[deep_value])
    with pytest.raises(ConfigError, match=r"nested deeper than 64 levels"):
        build_config(RunConfig, overrides=["target.path=" + "{a: " * 3000 + "1" + "}" * 3000])
    f = tmp_path / "deep.yaml"
    f.write_text("target:\n  path: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml: nested deeper than 64 levels \(line 2"):
        build_config(RunConfig, f)
    for argv in (["config", "show", "--set", deep_key], ["config", "show", "--set", deep_value],
                 ["config", "show", "--config", str(f)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("peagle: error: ") and len(err) < 400, err[:1000]
    # 64 levels (the mapping and 63 lists) are allowed: the limit, not an off-by-one
    value, depth = parse_config_text("a: " + "[" * 63 + "]" * 63)["a"], 0
    while value is not None:
        value, depth = (value[0] if value else None), depth + 1
    assert depth == 63
    with pytest.raises(ConfigError, match="deeper than 64"):
        parse_config_text("a: " + "[" * 64 + "]" * 64)


def test_empty_key_parts_and_oversized_files(tmp_path):
    for bad in ("draft..num_layers=2", ".=1", "draft.=2"):
        with pytest.raises(ConfigError, match="empty key part"):
            build_config(RunConfig, overrides=[bad])
    f = tmp_path / "big.yaml"
    f.write_text("target:\n  path: " + "x" * (C.MAX_YAML_BYTES + 10) + "\n")
    with pytest.raises(ConfigError, match=rf"config file {f}: larger than {C.MAX_YAML_BYTES} bytes"):
        build_config(RunConfig, f)


# ---------------------------------------------------------------------------------------------- not a config


@pytest.mark.parametrize("content, why", [
    (random.Random(29).randbytes(4096), "not"),
    (b"draft:\n  num_layers: \xff\xfe2\n", "not UTF-8 text (invalid byte at offset 21)"),
    (b"draft:\n  num_layers: 2\x00\n", "not a text file (NUL byte at offset 22)"),
    ("draft:\n  num_layers: 2\n".encode("utf-16"), "not"),
    (b"\x7fELF\x02\x01\x01" + bytes(range(256)), "not"),
    (b"draft:\n  num_layers: \x01\n", "not valid YAML: special characters are not allowed (character #x0001"),
])
def test_binary_config_is_a_clear_error_naming_the_file(tmp_path, capsys, content, why):
    from peagle.cli import main

    f = tmp_path / "run.bin"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match="run.bin") as e:
        build_config(RunConfig, f)
    assert why in str(e.value) and len(str(e.value)) < 200
    assert main(["config", "show", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"peagle: error: config file {f}: ") and why in err


def test_a_directory_or_unreadable_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"config file {tmp_path}: cannot be read"):
        build_config(RunConfig, tmp_path)


def test_a_profile_that_is_not_a_profile_is_not_echoed(tmp_path, capsys):
    # `--profile ../../../etc/passwd` printed the file (a YAML string) in the error
    rel = os.path.relpath("/etc/passwd", Path.cwd())
    first_line = Path("/etc/passwd").read_text().splitlines()[0]
    assert pipeline_main(["render", "--profile", rel, "--out", str(tmp_path / "objs")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"peagle: error: cluster profile {rel}: top level must be a mapping, got str"
    assert first_line not in err
    secret = "hunter2-s3cr3t"
    for text in (f"password={secret}\nuser=admin\n", f"[default]\naws_secret_access_key = {secret}\n",
                 f"key: [unclosed {secret}\n", f"\tindented: {secret}\n", f"a: b: {secret}\n"):
        p = tmp_path / "creds"
        p.write_text(text)
        assert pipeline_main(["render", "--profile", str(p), "--out", str(tmp_path / "objs")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"peagle: error: cluster profile {p}: ") and secret not in err, err
        with pytest.raises(ConfigError) as e:
            build_config(RunConfig, p)
        assert secret not in str(e.value) and str(p) in str(e.value)
    assert not (tmp_path / "objs").exists()


# ---------------------------------------------------------------------------------------------- NaN and inf


def _float_fields(model: type, prefix: str = "") -> list[tuple[str, bool]]:
    """(dotted key, is a list) of every float field under ``model``."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if isinstance(ann, type) and issubclass(ann, C.StrictModel):
            out += _float_fields(ann, f"{prefix}{name}.")
        elif ann is float or (args == [float] and typing.get_origin(ann) is not list):
            out.append((prefix + name, False))
        elif typing.get_origin(ann) in (list, tuple) and float in args:
            out.append((prefix + name, True))
    return out


def test_nan_and_inf_are_refused_in_every_float_setting():
    fields = _float_fields(RunConfig)
    assert len(fields) >= 15 and ("train.lr", False) in fields and ("train.betas", True) in fields
    for key, is_list in fields:
        for text in (".nan", ".inf", "-.inf", "nan", "inf", "1e999"):
            value = f"[{text}, {text}]" if is_list else text
            with pytest.raises(ConfigError, match=rf"'{key}(\.0)?'.*finite number"):
                build_config(RunConfig, overrides=[f"{key}={value}"])
    profile_fields = _float_fields(ClusterProfile)
    assert ("trainjob.timeout_s", False) in profile_fields
    for key, _ in profile_fields:
        section, name = key.rsplit(".", 1)
        with pytest.raises(ValueError, match="finite number"):
            ClusterProfile.model_fields[section].annotation.model_validate({name: float("inf")})


def test_long_values_are_not_echoed_in_full():
    for override in ("target.path=[" + ", ".join(["x" * 50] * 2000) + "]", "draft.arch=" + "y" * 100_000,
                     "draft.num_layers={" + ", ".join(f"k{i}: {i}" for i in range(5000)) + "}",
                     "z" * 10_000 + ".a=1", "draft." + "q" * 10_000 + "=1"):
        with pytest.raises(ConfigError) as e:
            build_config(RunConfig, overrides=[override])
        assert len(str(e.value)) < 500, str(e.value)[:1000]
    many = [f"draft.k{i}=1" for i in range(500)]
    with pytest.raises(ConfigError, match="490 more errors") as e:
        build_config(RunConfig, overrides=many)
    assert len(str(e.value)) < 800
    assert len(C.short_repr("a" * 1000)) <= 80
    nested: list = []
    nested.append(nested)
    assert len(C.short_repr(nested)) <= 80 and len(C.short_repr(10 ** 5000)) <= 80


# ---------------------------------------------------------------------------------------------- fuzz


def test_fuzz_config_loader_and_set(tmp_path):
    rng = random.Random(2929)
    f = tmp_path / "fuzz.yaml"
    outcomes: dict[str, int] = {}
    failures = []
    n = 0
    for i in range(400):  # files, with and without --set
        kind, content = document(rng)
        f.write_bytes(content)
        overrides = [set_string(rng) for _ in range(rng.choice([0, 0, 1, 2]))]
        for what, fn, args in (("build_config", build_config, (RunConfig, f, overrides)),
                               ("load_profile", load_profile, (f,))):
            result = check(fn, *args)
            n += 1
            outcomes[result or "loaded"] = outcomes.get(result or "loaded", 0) + 1
            if result not in ("", "ConfigError"):
                failures.append((i, kind, what, content[:120], [o[:80] for o in overrides], result))
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            continue
        result = check(parse_config_text, text)
        n += 1
        if result not in ("", "ConfigError"):
            failures.append((i, kind, "parse_config_text", content[:120], [], result))
    for i in range(500):  # --set alone
        overrides = [set_string(rng) for _ in range(rng.randrange(1, 4))]
        result = check(build_config, RunConfig, None, overrides)
        n += 1
        outcomes[result or "loaded"] = outcomes.get(result or "loaded", 0) + 1
        if result not in ("", "ConfigError"):
            failures.append((i, "set", "build_config", b"", [o[:80] for o in overrides], result))
    assert not failures, failures[:10]
    print(f"{n} inputs: {outcomes}")
    assert n >= 1000 and outcomes.get("loaded", 0) >= 50 and outcomes["ConfigError"] >= 500, outcomes


def test_fuzz_sample_through_the_real_cli(tmp_path, capsys):
    """``peagle config show`` (in-process): exit 0, or exit 2 with one ``peagle: error:`` line, no traceback."""
    rng = random.Random(4242)
    cases = []
    for i in range(6):
        f = tmp_path / f"c{i}.yaml"
        kind, content = document(rng)
        f.write_bytes(content)
        sets = [a for _ in range(rng.randrange(3)) for a in ("--set", set_string(rng)[:20_000])]
        cases.append(["config", "show", "--config", str(f), *sets])
    bomb_file = tmp_path / "bomb.yaml"
    bomb_file.write_text(bomb(9))
    binary = tmp_path / "random.bin"
    binary.write_bytes(random.Random(7).randbytes(8192))
    cases += [["config", "show", "--config", str(bomb_file)], ["config", "show", "--config", str(binary)]]
    results = [_cli(argv, capsys) for argv in cases]
    for argv, (rc, out, err) in zip(cases, results):
        if rc == 0:
            assert err == "" and yaml.safe_load(out)["draft"], argv[:6]
        else:
            _assert_refused(rc, err)
    assert results[-2][2].startswith(f"peagle: error: config file {bomb_file}: more than 100000 values")
    assert results[-1][2].startswith(f"peagle: error: config file {binary}: not")


# ---- settings checked together (#26): combinations that cannot work are refused, naming both keys -------
# (folded from test_issue26_settings by h3)

from peagle.run_config import check_trainer_order  # noqa: E402


STREAMING_BACK_PRESSURE = {"train.data_mode": "streaming", "train.stream.delete_consumed": True,
                           "train.val_fraction": 0.0, "extract.max_sets_ahead": 2}


def both_named(exc: pytest.ExceptionInfo, *keys: str) -> bool:
    return all(k in str(exc.value) for k in keys)


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


def test_regenerate_follows_prepare_unless_set():
    """``regenerate.max_conversations`` unset: as many conversations as prepare keeps rows; set, it
    changes nothing else (it used to set ``prepare.max_samples`` too, through one pipeline parameter)."""
    cfg = build_config(RunConfig, values={"prepare.max_samples": 1900})
    assert cfg.regenerate.max_conversations == 1900
    cfg = build_config(RunConfig, values={"prepare.max_samples": 100, "regenerate.max_conversations": 300})
    assert (cfg.prepare.max_samples, cfg.regenerate.max_conversations) == (100, 300)
    assert build_config(RunConfig).regenerate.max_conversations is None
