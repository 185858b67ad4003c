"""Tiny real targets for tests: the package's builder (:mod:`peagle.model.tiny`), under the names the
tests import (``from tiny import build_target``)."""
from peagle.model.tiny import CHATML, SPECIALS, build_target, train_tokenizer

__all__ = ["CHATML", "SPECIALS", "build_target", "train_tokenizer"]
