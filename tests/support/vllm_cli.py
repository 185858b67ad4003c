"""Run a peagle command's ``main(argv)`` in-process where a vLLM test used a subprocess only for its exit
code and output: the test pays no second torch/peagle import (the stage still starts its vLLM engine in
its own child interpreter, as in production)."""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class Ran:
    """What a subprocess.CompletedProcess gave these tests: the exit code and the two streams."""

    returncode: int
    stdout: str
    stderr: str


def run_main(main: Callable[[list[str]], int], argv: Sequence[str], **env: str) -> Ran:
    """``main(argv)`` with stdout/stderr captured and ``env`` set for the call; SystemExit becomes the code."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return Ran(int(code or 0), out.getvalue(), err.getvalue())


def evaluate(*args: str) -> Ran:
    """``python -m peagle.evaluate ARGS``, in-process (offline: local model directories only)."""
    from peagle.evaluate.__main__ import main

    return run_main(main, args, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
