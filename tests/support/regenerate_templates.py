"""A target whose chat template never finishes rendering (regeneration's template time limit), and a guard
that kills the test run with tracebacks should such a render never end."""
from __future__ import annotations

import faulthandler
import shutil
import sys
from pathlib import Path

ENDLESS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")


def endless_target_copy(target: Path, out: Path) -> Path:
    """A copy of ``target`` (the model too: vLLM loads it) whose tokenizer has the ENDLESS template."""
    from transformers import AutoTokenizer

    shutil.copytree(target, out)
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.chat_template = ENDLESS
    tok.save_pretrained(str(out))
    return out


def hang_guard_on(seconds: float = 120) -> None:
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)


def hang_guard_off() -> None:
    faulthandler.cancel_dump_traceback_later()
