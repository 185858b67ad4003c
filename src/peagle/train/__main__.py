"""``python -m peagle.train --config run.yaml [--set train.lr=3e-4 ...]`` (also under torchrun).

Reads the run configuration (:class:`peagle.run_config.RunConfig`; training uses its ``target``,
``draft``, ``train`` and ``work_dir`` sections), trains or resumes, prints progress to stderr and writes ``<work_dir>/metrics.jsonl``.
Exit status 2 for configuration or data errors (reported in one line, before training starts).
"""
from __future__ import annotations

import argparse
import logging
import sys

from ..config import add_run_config_args, build_config
from ..errors import PeagleError, report
from ..run_config import RunConfig
from .loop import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peagle.train", description=__doc__.splitlines()[0])
    add_run_config_args(parser, reads="target / draft / train / work_dir sections are read",
                        example="train.max_steps=100")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = build_config(RunConfig, args.config, args.overrides)
        result = train(cfg)
    except PeagleError as exc:
        return report(exc)
    if result.final_uri:
        print(result.final_uri)
    return 0


if __name__ == "__main__":
    sys.exit(main())
