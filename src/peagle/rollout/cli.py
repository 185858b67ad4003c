"""Roll a gated candidate draft out beside the serving draft on the cluster; promote or roll back on live acceptance.

    peagle rollout --name N [-n NS] --mode kserve|deployment [--routing kserve-canary|route|httproute] \\
        STABLE'S MODEL SOURCE (as peagle deploy: --data-connection S --path P | --storage-uri | --pvc ...) \\
        --candidate-draft URI (--candidate-path PREFIX | --candidate-draft-uri URI) --traffic LOG \\
        [--gate gate.json] [--lineage lineage.json] [--canary-percent 10] [--out URI] \\
        [--config run.yaml --set rollout.min_requests=64 ...]
    peagle rollout ... --render-only DIR   every phase's objects as YAML: DIR/canary, DIR/stable-with-canary,
                                           DIR/promoted (no cluster)
    peagle rollout ... --abort             all traffic to the stable and the canary removed (stable untouched)
    peagle rollout local ...               the same loop on this machine, two `peagle serve` processes (--help)

The stable release's flags must render what `peagle deploy` deployed (the rollout refuses to touch a
stable that serves another draft). The candidate is served from its own model source
(--candidate-path: the prefix holding its target/ and draft/; --candidate-draft-uri with storage URIs);
--candidate-draft is the published draft itself, which names it (its fingerprint,
peagle.records.identity: what its served records carry). The live records of both versions are read from the traffic log --traffic, and the
decision is recorded in the loop history (rollout.history, default <traffic>/_loop); with --out also in
<out>/rollout/decision.json, and a promotion under <out>/promotion/. A rerun after an interruption
finishes the rollout or removes the canary.

Where the stable release serves the draft swap endpoint (chart swap.enabled), promotion swaps the draft inside
its running pods, one at a time, instead of restarting it (rollout.in_place, on by default): the endpoint's
token must be in PEAGLE_SWAP_TOKEN (rollout.swap_token_env), and the pods' IPs reachable from where this runs.
A pod that refuses falls back to the restart. docs/traffic.md, "Swapping the draft in place".

Exit status: 0 promoted (or --render-only / --abort done), 1 rolled back, 2 bad input, 3 failed.
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, TypeVar

from pydantic import Field

from .. import config as C
from ..deploy.cli import add_release_flags, check_arguments, values_from_args
from ..deploy.kube import Apis, DeployError, current_namespace
from ..deploy.render import write_manifests
from ..deploy.values import check_flags, check_prefix, rule_of
from ..errors import PeagleError, report
from ..records.lineage import Lineage
from ..stage_io import check_writable, write_errors
from .assemble import ClusterRollout, cluster_rollout, read_gate, read_lineage
from .cluster import ClusterBackend
from .controller import abort_rollout
from .objects import RolloutObjects, candidate_values
from .settings import RolloutSettings

T = TypeVar("T")


class RolloutCommandConfig(C.StrictModel):
    """``--config`` / ``--set`` of ``peagle rollout``: the run configuration's ``rollout`` section."""

    rollout: RolloutSettings = Field(default_factory=RolloutSettings)


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="peagle rollout", description=doc[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n\n".join(doc[1:]))
    add_release_flags(p, chart_set_prefix="chart-")  # the stable release, as peagle deploy renders it
    cand = p.add_argument_group("candidate")
    cand.add_argument("--candidate-draft", metavar="URI",
                      help="the published candidate draft (required unless --abort)")
    source = cand.add_mutually_exclusive_group()
    source.add_argument("--candidate-path", metavar="PREFIX",
                        help="the candidate's model source: prefix (or --pvc sub-path) holding its target/ and draft/")
    source.add_argument("--candidate-draft-uri", metavar="URI",
                        help="the candidate's model source with storage URIs (--target-uri/--draft-uri): its draft")
    cand.add_argument("--gate", metavar="FILE", help="the candidate's gate result (gate.json or gate output); "
                      "refused unless it passed this candidate. Without it the candidate rolls out unvetted")
    cand.add_argument("--lineage", metavar="FILE", help="the refresh's lineage.json of this candidate (recorded "
                      "with a promotion)")
    roll = p.add_argument_group("rollout")
    roll.add_argument("--traffic", metavar="URI", help="traffic log both versions capture into (local directory or "
                      "s3:// URI; required unless --render-only / --abort)")
    roll.add_argument("--out", metavar="URI", help="where the decision and a promotion record are published")
    C.add_run_config_args(roll, reads="its 'rollout' section is read; other sections are ignored",
                          example="rollout.min_requests=64")
    act = roll.add_mutually_exclusive_group()
    act.add_argument("--render-only", metavar="DIR", help="write every phase's objects to DIR instead of rolling out")
    act.add_argument("--abort", action="store_true", help="remove the canary (the stable is not touched)")
    roll.add_argument("--kubeconfig")
    roll.add_argument("--context")
    C.add_flags(p, RolloutSettings, "rollout")
    return p


def load_settings(ns: argparse.Namespace) -> RolloutSettings:
    """YAML < ``--set`` < flags."""
    return C.build_config(RolloutCommandConfig, ns.config, ns.overrides, C.flag_values(ns),
                          own_sections_only=True).rollout


def check_input(ns: argparse.Namespace) -> None:
    """The flags' values and which ones this action needs (``--flag: why``, exit 2)."""

    check_arguments(ns)
    # --candidate-path is what the stable's --path (or --storage-uri) is, for the candidate
    path_rule = rule_of("volumePath") if ns.pvc else rule_of("storageUri") if ns.storage_uri else check_prefix
    check_flags(ns, {"--candidate-path": path_rule,
                     "--candidate-draft-uri": rule_of("storageUri")})
    if ns.abort:
        return
    if not ns.candidate_draft:
        raise C.ConfigError("--candidate-draft: required (the published draft to roll out)")
    if not (ns.render_only or ns.traffic):
        raise C.ConfigError("--traffic: required (the traffic log the live records are read from)")


def assemble(ns: argparse.Namespace, namespace: str, routing: str) -> tuple["ClusterRollout", str | None]:
    """The rollout the flags describe (gate and lineage checked against the candidate), and the fingerprint
    of the target both versions serve as the lineage or the gate names it (None: neither given)."""

    stable_values = values_from_args(ns)
    gate = lineage = target = None
    if ns.gate:
        result = _flag("--gate", read_gate, ns.gate, ns.candidate_draft)
        gate, target = result.summary(ns.gate), (result.target or {}).get("fingerprint")
    if ns.lineage:
        lineage = _flag("--lineage", read_lineage, ns.lineage, ns.candidate_draft)
        target = lineage.target.fingerprint or target
    values = candidate_values(stable_values, draft_uri=ns.candidate_draft_uri, path=ns.candidate_path)
    rollout = cluster_rollout(name=ns.name, namespace=namespace, routing=routing, mode=ns.mode,
                              stable_values=stable_values, candidate_draft=ns.candidate_draft,
                              candidate_values=values, gate=gate, lineage=lineage, chart=ns.chart)
    return rollout, target


def _flag(flag: str, read: Callable[..., T], *args: Any) -> T:
    """``read(*args)``; an error names ``flag``."""
    try:
        return read(*args)
    except PeagleError as exc:
        raise C.ConfigError(f"{flag}: {exc}") from None


def stable_draft(ns: argparse.Namespace, lineage: "Lineage | None") -> str:
    """Where the stable's draft is, as the decision records it: the lineage's base draft, else the model source."""
    if lineage:
        return lineage.base_draft.uri
    if ns.draft_uri:
        return ns.draft_uri
    if ns.storage_uri:
        return f"{ns.storage_uri.rstrip('/')}/draft"
    prefix = "/".join(part for part in ((ns.path or "").strip("/"), "draft") if part)
    return f"pvc://{ns.pvc}/{prefix}" if ns.pvc else f"data connection {ns.data_connection}: {prefix}"


def render_phases(rollout: "ClusterRollout", percent: int, out_dir: str) -> list[Path]:
    """``<out_dir>/<phase>/NN-kind-name.yaml`` for every phase (:data:`.assemble.PHASES`)."""

    check_writable(out_dir, directory=True)
    phases = rollout.phases(percent)
    paths = []
    with write_errors(out_dir, os.path.abspath(out_dir)):
        for phase, objs in phases.items():
            paths += write_manifests(objs, Path(out_dir) / phase)
    return paths


def main(argv: list[str] | None = None, apis: Apis | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    try:
        settings = load_settings(ns)
        check_input(ns)
        namespace = ns.namespace or current_namespace()
        if ns.abort:  # no candidate: the canary is the one the stable endpoint object names
            objects = RolloutObjects(name=ns.name, namespace=namespace, routing=settings.routing, mode=ns.mode,
                                     stable_values=values_from_args(ns), chart=ns.chart)
        else:
            rollout, target = assemble(ns, namespace, settings.routing)
        if ns.render_only:
            for path in render_phases(rollout, settings.canary_percent, ns.render_only):
                print(path)
            return 0
    except PeagleError as exc:  # a bad flag, value, gate or lineage (exit 2)
        return report(exc)
    except (OSError, ValueError) as exc:  # a values or config file that cannot be read or parsed
        print(f"peagle: error: {exc}", file=sys.stderr)
        return 2
    if apis is None:
        try:
            apis = Apis.from_environment(ns.kubeconfig, ns.context)
        except Exception as exc:  # kubernetes.config.ConfigException and file errors
            print(f"peagle: error: no cluster credentials ({exc})", file=sys.stderr)
            return 2
    say = partial(print, flush=True)
    try:
        if ns.abort:
            abort_rollout(ClusterBackend(apis, objects, ready_timeout_s=settings.ready_timeout_s, say=say), say=say)
            return 0
        if rollout.candidate.gate is None:
            print(f"peagle: warning: no --gate: the candidate {rollout.candidate.fingerprint} rolls out unvetted "
                  "(nothing checked it beats the serving draft offline)", file=sys.stderr)
        decision = rollout.run(apis, traffic=ns.traffic, settings=settings, target_fingerprint=target,
                               stable_draft=stable_draft(ns, rollout.candidate.lineage), out=ns.out, say=say)
    except DeployError as exc:  # the cluster did not do what was asked: a failed rollout, not a deploy
        print(f"peagle: error: {exc}", file=sys.stderr)
        return 3
    except PeagleError as exc:  # RolloutError (3), a damaged history or traffic log
        return report(exc)
    print(decision.to_json())
    return 0 if decision.decision == "promote" else 1


if __name__ == "__main__":
    sys.exit(main())
