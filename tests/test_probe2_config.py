"""User-supplied YAML and ``--set`` values (issue #29): alias bombs, deep nesting, binary files, files that
are not profiles, profile durations, NaN/inf, and a seeded fuzz of the loader -- every input either loads
or is a ConfigError (exit 2, ``peagle: error:``) with a short message; never a traceback."""
from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from peagle import config as C
from peagle.config import ConfigError, build_config
from peagle.pipeline.__main__ import main as pipeline_main
from peagle.pipeline.params import flatten, parse_config_text
from peagle.pipeline.profile import ClusterProfile, load_profile
from peagle.run_config import RunConfig

MAX_MESSAGE = 3000  # an error is a few lines at most, whatever the input


def _bomb(levels: int, width: int = 9, under: str = "target:\n  path: ") -> str:
    """The "billion laughs": each level a list of ``width`` aliases to the one below (width**levels strings)."""
    lines = ['l0: &l0 [' + ", ".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + f"\n{under}*l{levels - 1}\n"


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real ``peagle`` command in a child limited to 3 GiB of address space (an alias bomb that got
    through would end in MemoryError, a traceback, instead of eating the machine)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, "-m", "peagle.cli", *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _assert_refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("peagle: error: ") and len(err) < MAX_MESSAGE, err[:2000]
    for n in needles:
        assert n in err, err
    return err


# ---------------------------------------------------------------------------------------------- alias bombs


def test_alias_bomb_is_refused_by_every_yaml_reader(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb(6))  # 531,441 strings expanded: the old message quoted them all (megabytes)
    with pytest.raises(ConfigError, match=r"config file .*bomb\.yaml: more than 100000 values") as e:
        build_config(RunConfig, f)
    assert len(str(e.value)) < 300
    f.write_text(_bomb(6, under="name: "))
    with pytest.raises(ConfigError, match=r"cluster profile .*bomb\.yaml: more than 100000 values") as e:
        load_profile(f)
    assert len(str(e.value)) < 300
    with pytest.raises(ConfigError, match=r"pipeline parameter 'config': more than 100000 values"):
        parse_config_text(_bomb(6))
    wide = "&a [" + ", ".join(["x"] * 200) + "]"  # 200 values, then 999 aliases to it: 200,000
    with pytest.raises(ConfigError, match=r"override 'target.path': more than 100000 values"):
        build_config(RunConfig, overrides=["target.path=[" + ", ".join([wide] + ["*a"] * 999) + "]"])
    with pytest.raises(ConfigError, match=r"more than 1000 aliases"):
        build_config(RunConfig, overrides=["target.path=[&a x" + ", *a" * 1001 + "]"])


def test_alias_bomb_is_refused_by_deploy_values_and_pipeline_submit(tmp_path, capsys):
    from peagle.deploy.cli import main as deploy_main

    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb(6, under="extra: "))
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


# ---------------------------------------------------------------------------------------------- profile durations


@pytest.mark.parametrize("field, value", [
    ("retry.backoff_duration", "abc"), ("retry.backoff_duration", "-60s"), ("retry.backoff_duration", "1.5h"),
    ("retry.backoff_duration", float("nan")), ("retry.backoff_duration", float("inf")),
    ("retry.backoff_duration", -1), ("retry.backoff_duration", 1e300), ("retry.backoff_duration", True),
    ("retry.backoff_duration", "99999999999999999999s"), ("retry.backoff_max_duration", "400d"),
    ("retry.backoff_max_duration", "1 fortnight"), ("retry.backoff_max_duration", [60]),
    ("retry.backoff_factor", float("nan")), ("retry.backoff_factor", float("inf")), ("retry.backoff_factor", -2),
    ("steps.train.timeout_s", 10**20), ("steps.train.timeout_s", float("inf")), ("steps.train.timeout_s", "1h"),
    ("steps.train.timeout_s", 0), ("trainjob.timeout_s", float("nan")), ("trainjob.timeout_s", float("inf")),
    ("trainjob.timeout_s", -1), ("trainjob.timeout_s", 1e300), ("trainjob.timeout_s", "abc"),
    ("trainjob.startup_grace_s", float("inf")), ("trainjob.poll_interval_s", 1e12),
    ("serving.timeout_s", float("inf")), ("serving.timeout_s", 10**30),
    ("accelerator.tolerations.0.toleration_seconds", 10**20),
    ("accelerator.tolerations.0.toleration_seconds", -5),
])
def test_bad_profile_duration_names_the_field(tmp_path, field, value):
    data: dict = {}
    cur = data
    parts = field.split(".")
    for i, p in enumerate(parts[:-1]):
        if parts[i + 1].isdigit():
            cur[p] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
            cur = cur[p][0]
            continue
        if p.isdigit():
            continue
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"cluster profile {f}: {field}: ") as e:
        load_profile(f)
    assert len(str(e.value)) < 400


def test_profile_durations_take_kfp_forms_and_compile(tmp_path, capsys):
    from kfp.dsl.structures import convert_duration_to_seconds

    f = tmp_path / "p.yaml"
    f.write_text("retry: {backoff_duration: 5 min, backoff_max_duration: 2h}\n")
    r = load_profile(f).retry
    assert (r.backoff_duration, r.backoff_max_duration) == ("300s", "7200s")
    for given, seconds in ((60, 60), ("1h", 3600), ("2 days", 172800), ("1w", 604800), (90.0, 90), ("0s", 0)):
        f.write_text(yaml.safe_dump({"retry": {"backoff_duration": given}}))
        assert convert_duration_to_seconds(load_profile(f).retry.backoff_duration) == seconds
    assert ClusterProfile().retry.backoff_max_duration == "3600s"
    # the compile command reports the field (a ValueError traceback from kfp before)
    f.write_text("retry: {backoff_duration: soon}\n")
    assert pipeline_main(["compile", "--profile", str(f), "--out", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"peagle: error: cluster profile {f}: retry.backoff_duration: ")


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


def _schema_keys(model: type, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, C.StrictModel):
            out += _schema_keys(field.annotation, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


KEYS = _schema_keys(RunConfig)
GOOD = {k: yaml.safe_dump(v, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()
        for k, v in flatten(RunConfig().model_dump(mode="json")).items()}  # every default, as YAML
WORDS = ["x", "qwen3", "llama", "bfloat16", "streaming", "/models/t", "s3://b/k", "héllo", "日本語", "😀",
         "\u200b", "\u202e", "a b", "it's", "#", "@x", "%", "`", "|", ">", "-", "?", "!", "&", "*"]
SCALARS = ["0", "-1", "7", "1_000", "0x1F", "0o17", "10000000000000000000000", "1.5", "-0.0", "1e-9", "3.", ".5",
           ".nan", ".NaN", ".inf", "-.inf", "+.Inf", "nan", "inf", "-inf", "NaN", "Infinity", "1e999", "-1e999",
           "true", "false", "yes", "no", "on", "off", "~", "null", "''", '""', "2020-01-01", "2020-13-45",
           "2001-12-14t21:59:43.10-05:00", "!!binary aGVsbG8=", "!!binary zz", "!!float abc", "!!int 1.5",
           "!!str 5", "!!python/name:os.system", "!!timestamp x", "!!set {a, b}", "!!omap [a: 1]",
           "!!null x", '"\\x00\\u2028"', "'quoted''s'", '"\\ud800"', "*undefined", "&anch 3"]


def _value(rng: random.Random, depth: int = 0) -> str:
    """A YAML value in flow style (fits after ``key: `` and after ``--set key=``)."""
    kind = rng.random()
    if kind < 0.35 or depth > 2:
        return rng.choice(SCALARS + WORDS)
    if kind < 0.45:
        return rng.choice(WORDS) * rng.choice([1, 100, 5000])
    if kind < 0.6:
        return "[" + ", ".join(_value(rng, depth + 1) for _ in range(rng.randrange(5))) + "]"
    if kind < 0.72:
        return "{" + ", ".join(f"{rng.choice(WORDS + ['k', 'lr'])}: {_value(rng, depth + 1)}"
                               for _ in range(rng.randrange(4))) + "}"
    if kind < 0.82:
        n = rng.choice([3, 60, 63, 64, 65, 100, 1000, 5000])
        return ("[" * n + "]" * n) if rng.random() < 0.5 else ("{a: " * n + "1" + "}" * n)
    if kind < 0.92:  # anchors and aliases inside one value
        w, levels = rng.randrange(2, 12), rng.randrange(1, 9)
        inner = "&v0 [" + ", ".join(["lol"] * w) + "]"
        for i in range(1, levels):  # [previous, &v<i> [*v<i-1> x w]]: w**levels values, nested 2 per level
            inner = f"[{inner}, &v{i} [" + ", ".join([f"*v{i - 1}"] * w) + "]]"
        return inner if rng.random() < 0.9 else "&r [*r]"
    return "".join(rng.choice("[]{},:&*!|>'\"#%@` -?\\\n\tab1.") for _ in range(rng.randrange(1, 30)))


def _set_string(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.7:
        key = rng.choice(KEYS)
    elif kind < 0.8:
        key = rng.choice(KEYS) + "." + ".".join(["b"] * rng.choice([1, 60, 70, 10_000]))
    elif kind < 0.9:
        key = rng.choice(["", " ", ".", "a..b", "draft.", ".draft", "é.ü", "a=b", "😀", "x" * 5000, "train.stream"])
    else:
        key = rng.choice(KEYS).upper()
    if rng.random() < 0.05:
        return key  # no '='
    if key in GOOD and rng.random() < 0.4:
        return f"{key}={GOOD[key]}"
    return f"{key}={_value(rng)}"


def _bomb_doc(rng: random.Random) -> str:
    width, levels = rng.randrange(2, 13), rng.randrange(2, 13)
    under = rng.choice(["target:\n  path: ", "train:\n  betas: ", "extra: ", "draft:\n  aux_layer_ids: "])
    return _bomb(levels, width, under)


def _alias_doc(rng: random.Random) -> str:
    n = rng.choice([2, 50, 200, 1001])
    kind = rng.randrange(5)
    if kind == 0:  # a chain of merges, the root merging the last one
        lines = ["m0: &m0 {lr: 0.001}"] + [f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: {i}}}" for i in range(1, n)]
        return "\n".join(lines) + f"\ntrain: {{<<: *m{n - 1}}}\n"
    if kind == 1:
        return "train: {<<: " + rng.choice(["*nope", "[1, 2]", "3", "&a {<<: *a}", "{<<: {<<: {lr: 1}}}"]) + "}\n"
    if kind == 2:
        return "x: &a [1]\n" + "".join(f"y{i}: *a\n" for i in range(n))
    if kind == 3:
        return rng.choice(["a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a &b 1\n", "a: &a 1\nb: &a 2\nc: *a\n", "*a: 1\n"])
    return f"a: &a {{{', '.join(f'k{i}: {i}' for i in range(rng.randrange(1, 200)))}}}\ntrain: {{<<: [*a, *a]}}\n"


def _config_doc(rng: random.Random) -> str:
    sections: dict[str, list[str]] = {}
    for _ in range(rng.randrange(1, 8)):
        key = rng.choice(KEYS) if rng.random() < 0.85 else rng.choice(["trian.lr", "draft.num_layer", "x", "é.ü"])
        section, _, rest = key.partition(".")
        value = GOOD[key] if key in GOOD and rng.random() < 0.5 else _value(rng)
        sections.setdefault(section, []).append(f"{rest or 'v'}: {value}")
    out = []
    for section, lines in sections.items():
        out.append(f"{section}:")
        out += [f"  {line}" for line in lines]
    return "\n".join(out) + "\n"


def _document(rng: random.Random) -> tuple[str, bytes]:
    """(kind, file content) of one generated config file."""
    kind = rng.choice(["config", "config", "config", "bomb", "alias", "deep", "big", "top", "binary", "mutant",
                       "unicode"])
    if kind == "config":
        return kind, _config_doc(rng).encode()
    if kind == "bomb":
        return kind, _bomb_doc(rng).encode()
    if kind == "alias":
        return kind, _alias_doc(rng).encode()
    if kind == "deep":
        n = rng.choice([10, 63, 64, 65, 200, 3000])
        if rng.random() < 0.3:  # block style
            n = min(n, 120)
            return kind, "".join("  " * i + "a:\n" for i in range(n)).encode() + b"  " * n + b"1\n"
        return kind, f"target:\n  path: {'[' * n}{']' * n}\n".encode()
    if kind == "big":
        size = rng.choice([1000, 20_000, C.MAX_YAML_BYTES + 1, 3 * C.MAX_YAML_BYTES])
        if rng.random() < 0.5:
            return kind, b"target:\n  path: " + b"x" * size + b"\n"
        n = min(size // 12, 300)
        return kind, ("extract:\n" + "".join(f"  k{i}: {i}\n" for i in range(n))).encode()
    if kind == "top":
        return kind, rng.choice(["- 1\n", "42\n", "'str'\n", "", "~\n", "---\na: 1\n---\nb: 2\n", "...\n",
                                 "%YAML 1.1\n---\ndraft: {num_layers: 2}\n", "%TAG ! tag:x,2000:\n--- !foo 1\n",
                                 "? [a]\n: 1\n", "{1: 2}\n", "draft: {1: 2}\n", "~: 1\n",
                                 "!!python/object:os.system {}\n",
                                 "\ufeffdraft: {num_layers: 2}\n", "draft:\n\tnum_layers: 2\n"]).encode()
    if kind == "binary":
        raw = rng.randbytes(rng.choice([1, 16, 4096]))
        return kind, rng.choice([raw, raw.replace(b"\0", b"\1"), _config_doc(rng).encode("utf-16"),
                                 b"draft: {num_layers: \xc3\x28}\n", _config_doc(rng).encode() + b"\0"])
    if kind == "mutant":
        text = list(_config_doc(rng))
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(text) + 1)
            op = rng.random()
            if op < 0.4 and text:
                del text[min(i, len(text) - 1)]
            elif op < 0.8:
                text.insert(i, rng.choice("[]{},:&*!|>'\"#%@`-?\\\n\t é\x85\u2028"))
            else:
                text.insert(i, chr(rng.randrange(0, 0x3000)))
        return kind, "".join(text).encode("utf-8", "surrogatepass")
    # unicode keys and values, control characters, odd line breaks
    key = rng.choice(["dräft", "目標", "😀", "draft\u200b", "draft\x7f", "train\u2028lr", "target"])
    odd = rng.choice(["", chr(rng.randrange(1, 32)), "\x85"])
    return kind, f"{key}:\n  path: {rng.choice(WORDS)}{odd}\n".encode()


def _check(fn, *args) -> str:
    """Run a loader; '' when it loaded, 'ConfigError' when it refused in a short message, else the failure."""
    try:
        fn(*args)
    except ConfigError as exc:
        text = str(exc)
        if len(text) > MAX_MESSAGE:
            return f"message of {len(text)} characters: {text[:200]}"
        return "ConfigError"
    except Exception as exc:  # noqa: BLE001 - what the fuzz looks for
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return ""


def test_fuzz_config_loader_and_set(tmp_path):
    rng = random.Random(2929)
    f = tmp_path / "fuzz.yaml"
    outcomes: dict[str, int] = {}
    failures = []
    n = 0
    for i in range(400):  # files, with and without --set
        kind, content = _document(rng)
        f.write_bytes(content)
        overrides = [_set_string(rng) for _ in range(rng.choice([0, 0, 1, 2]))]
        for what, fn, args in (("build_config", build_config, (RunConfig, f, overrides)),
                               ("load_profile", load_profile, (f,))):
            result = _check(fn, *args)
            n += 1
            outcomes[result or "loaded"] = outcomes.get(result or "loaded", 0) + 1
            if result not in ("", "ConfigError"):
                failures.append((i, kind, what, content[:120], [o[:80] for o in overrides], result))
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            continue
        result = _check(parse_config_text, text)
        n += 1
        if result not in ("", "ConfigError"):
            failures.append((i, kind, "parse_config_text", content[:120], [], result))
    for i in range(500):  # --set alone
        overrides = [_set_string(rng) for _ in range(rng.randrange(1, 4))]
        result = _check(build_config, RunConfig, None, overrides)
        n += 1
        outcomes[result or "loaded"] = outcomes.get(result or "loaded", 0) + 1
        if result not in ("", "ConfigError"):
            failures.append((i, "set", "build_config", b"", [o[:80] for o in overrides], result))
    assert not failures, failures[:10]
    print(f"{n} inputs: {outcomes}")
    assert n >= 1000 and outcomes.get("loaded", 0) >= 50 and outcomes["ConfigError"] >= 500, outcomes


def test_fuzz_sample_through_the_real_cli(tmp_path):
    """The real ``peagle config show`` in a child: exit 0, or exit 2 with one ``peagle: error:`` line."""
    rng = random.Random(4242)
    cases = []
    for i in range(6):
        f = tmp_path / f"c{i}.yaml"
        kind, content = _document(rng)
        f.write_bytes(content)
        sets = [a for _ in range(rng.randrange(3)) for a in ("--set", _set_string(rng)[:20_000])]
        cases.append(["config", "show", "--config", str(f), *sets])
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb(9))
    binary = tmp_path / "random.bin"
    binary.write_bytes(random.Random(7).randbytes(8192))
    cases += [["config", "show", "--config", str(bomb)], ["config", "show", "--config", str(binary)]]
    with ThreadPoolExecutor(3) as pool:
        procs = list(pool.map(lambda argv: _cli(*argv), cases))
    for argv, proc in zip(cases, procs):
        assert "Traceback" not in proc.stderr, (argv[:6], proc.stderr[-3000:])
        if proc.returncode == 0:
            assert proc.stderr == "" and yaml.safe_load(proc.stdout)["draft"], argv[:6]
        else:
            _assert_refused(proc)
    assert procs[-2].stderr.startswith(f"peagle: error: config file {bomb}: more than 100000 values")
    assert procs[-1].stderr.startswith(f"peagle: error: config file {binary}: not")
