"""Stand-in stages for the scratch tests: a process that stages its output with peagle.stage_io.staged,
prints its staging directory and hangs until killed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

SRC = str(REPO / "src")

# A stage that stages its output and then hangs (until killed): prints its staging directory.
S3_STAGE = """
import sys, time
from peagle.stage_io import staged
with staged(sys.argv[1], kind="test-output") as d:
    (d / "rows.parquet").write_bytes(b"x" * 1000)
    print(d, flush=True)
    time.sleep(600)
"""
LOCAL_STAGE = """
import sys, time
from pathlib import Path
from peagle.stage_io import staged
with staged(Path(sys.argv[1]), kind="test-output") as d:
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    print(d, flush=True)
    time.sleep(600)
"""


def start_stager(code: str, arg: str, env: dict) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", code, arg], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "PYTHONPATH": SRC})
    line = proc.stdout.readline().strip()
    assert line, f"stager exited with {proc.wait()}"
    return proc, Path(line)
