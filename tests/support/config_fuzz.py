"""Generators for the config-loader fuzz (tests/unit/test_config.py): alias bombs, deep nesting, binary
files, mutated and unicode documents, and ``--set`` strings over every RunConfig key."""
from __future__ import annotations

import random

import yaml

from peagle import config as C
from peagle.config import ConfigError
from peagle.pipeline.params import flatten
from peagle.run_config import RunConfig

MAX_MESSAGE = 3000  # an error is a few lines at most, whatever the input


def bomb(levels: int, width: int = 9, under: str = "target:\n  path: ") -> str:
    """The "billion laughs": each level a list of ``width`` aliases to the one below (width**levels strings)."""
    lines = ['l0: &l0 [' + ", ".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "\n".join(lines) + f"\n{under}*l{levels - 1}\n"


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


def set_string(rng: random.Random) -> str:
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


def bomb_doc(rng: random.Random) -> str:
    width, levels = rng.randrange(2, 13), rng.randrange(2, 13)
    under = rng.choice(["target:\n  path: ", "train:\n  betas: ", "extra: ", "draft:\n  aux_layer_ids: "])
    return bomb(levels, width, under)


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


def document(rng: random.Random) -> tuple[str, bytes]:
    """(kind, file content) of one generated config file."""
    kind = rng.choice(["config", "config", "config", "bomb", "alias", "deep", "big", "top", "binary", "mutant",
                       "unicode"])
    if kind == "config":
        return kind, _config_doc(rng).encode()
    if kind == "bomb":
        return kind, bomb_doc(rng).encode()
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


def check(fn, *args) -> str:
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
