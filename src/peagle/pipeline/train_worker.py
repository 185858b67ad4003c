"""``python -m peagle.pipeline.train_worker --run-uri URI [--nproc-per-node N]``: start training for a run.

Runs where the training processes run: in the train step's own pod (``train_mode=pod``) or as the
command of every TrainJob node (``train_mode=trainjob``). It fetches the run's settings and the
normalised target from the object store once per node, writes a ``peagle.train`` config with the
run's paths, then starts the processes:

* under Kubeflow Trainer (``PET_NNODES`` set): ``torchrun`` with the ``PET_*`` rendezvous settings
  Trainer injects (torchrun reads them as its flags);
* ``--nproc-per-node`` N > 1 in one pod: ``torchrun --standalone --nproc-per-node=N``;
* otherwise one plain process.

Training resumes from the newest complete checkpoint under ``<run>/train`` (``train.resume``), so a
retried step or a replacement TrainJob continues instead of starting over.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import yaml

from ..run_config import RunConfig
from .layout import RunLayout


def training_config(run_config: RunConfig, layout: RunLayout, target_dir: str, work_dir: str) -> RunConfig:
    """The run's configuration with the paths this node trains with. A streaming trainer reads the
    extraction's layout and prepared data from the plan the extract workers publish
    (:class:`peagle.extract.hidden_states.ExtractionPlan`), not from here."""
    data = run_config.model_dump(mode="json")
    data["target"]["path"] = str(target_dir)
    data["train"]["data"] = layout.hidden_states("train")
    data["train"]["output"] = layout.train
    data["work_dir"] = str(work_dir)
    return RunConfig.model_validate(data)


def command(config_path: str, nproc_per_node: int, env: dict[str, str] | os._Environ) -> list[str]:
    """The process launch line (see the module docstring)."""
    train = ["-m", "peagle.train", "--config", str(config_path)]
    launcher = [sys.executable, "-m", "torch.distributed.run"]  # = torchrun, without relying on PATH
    if env.get("PET_NNODES"):
        return [*launcher, *train]
    if nproc_per_node > 1:
        return [*launcher, "--standalone", f"--nproc-per-node={nproc_per_node}", *train]
    return [sys.executable, *train]


def run_training(run_uri: str, nproc_per_node: int | None = None, work_dir: str | None = None) -> int:
    """Fetch, configure and run the training processes for ``run_uri``; returns their exit status."""
    from .connection import DATA_CONNECTION_ENV, check_data_connection
    from .steps import fetch, load_run

    check_data_connection(os.environ.get(DATA_CONNECTION_ENV, ""), {"the run": run_uri})
    run, layout = load_run(run_uri)
    nproc = nproc_per_node or int(os.environ.get("PET_NPROC_PER_NODE") or run.params.num_gpus)
    # One scratch directory per run (the same for a retry of it): two kfp.local runs on one machine
    # must not write each other's train.yaml.
    run_key = hashlib.sha256(run_uri.encode()).hexdigest()[:12]
    work = Path(work_dir or os.environ.get("PEAGLE_TRAIN_WORK")
                or Path(os.environ.get("TMPDIR", "/tmp")) / f"peagle-train-{run_key}")
    work.mkdir(parents=True, exist_ok=True)
    target = fetch(layout.target)
    cfg = training_config(run.config, layout, str(target), str(work))
    config_path = work / "train.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    cmd = command(str(config_path), nproc, os.environ)
    print("[peagle] training: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peagle.pipeline.train_worker", description=__doc__.splitlines()[0])
    p.add_argument("--run-uri", required=True, help="the run's prefix (s3://... or a local directory)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="training processes on this node (default: PET_NPROC_PER_NODE, else the run's num_gpus)")
    p.add_argument("--work-dir", default=None, help="local scratch (config, metrics.jsonl, checkpoint staging)")
    ns = p.parse_args(argv)
    return run_training(ns.run_uri, ns.nproc_per_node, ns.work_dir)


if __name__ == "__main__":
    sys.exit(main())
