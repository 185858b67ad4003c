"""``python -m peagle.deploy``: serve a run's target + P-EAGLE draft on Kubernetes with vLLM.

Renders ``charts/peagle-serving`` with values derived from the arguments, then either writes the
manifests (``--render-only DIR``) or applies them (create, or patch when present), waits until the
InferenceService (or Deployment) is ready, sends one chat request and prints the endpoint.

Exit codes: 0 ready (and answered), 1 deploy failed or timed out, 2 bad arguments / render error.
Arguments that end up in the manifests are checked first (:mod:`.values`): ``peagle: error: --image: why``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import PeagleError, report
from ..records.identity import identify_draft
from ..stage_io import join
from .kube import Apis, apply, current_namespace, endpoint, fingerprint_of, wait_ready
from .render import render, values_for, write_manifests
from .smoke import chat, require_model
from .values import check_capture_uri, check_flags, check_image, check_prefix, rule_of

# Flags whose values land in the manifests, and their rule (the chart's schema holds the same ones).
ARGUMENT_RULES = {
    "--name": rule_of("objectName"),
    "--namespace": rule_of("dnsLabel"),
    "--data-connection": rule_of("dnsSubdomain"),
    "--path": check_prefix,  # an object-store prefix; with --pvc a sub-path of the claim (check_arguments)
    "--storage-uri": rule_of("storageUri"),
    "--target-uri": rule_of("storageUri"),
    "--draft-uri": rule_of("storageUri"),
    "--pvc": rule_of("dnsSubdomain"),
    "--service-account": rule_of("dnsSubdomain"),
    "--image": check_image,
    "--capture": check_capture_uri,
    "--capture-secret": rule_of("dnsSubdomain"),
}


def check_arguments(ns: argparse.Namespace) -> None:
    """Raise :class:`.values.InvalidValue` ``--flag: why`` for the first bad value in :data:`ARGUMENT_RULES`."""
    flag_rules = dict(ARGUMENT_RULES)
    if ns.pvc:
        flag_rules["--path"] = rule_of("volumePath")
    check_flags(ns, flag_rules)


def add_release_flags(p: argparse.ArgumentParser, *, chart_set_prefix: str = "") -> None:
    """The flags that make a release's chart values (:func:`values_from_args`): ``--name``, ``--namespace``,
    ``--mode``, the model source and the serving settings. ``chart_set_prefix`` spells Helm's ``--set`` /
    ``--set-json`` (``chart-``: ``--chart-set``, for a command whose ``--set`` overrides its own settings)."""
    p.add_argument("--name", required=True,
                   help="InferenceService / Deployment name (DNS-1035 label, at most 53 characters)")
    p.add_argument("--namespace", "-n", default=None,
                   help="target namespace (default: the pod's namespace in-cluster, else 'default')")
    p.add_argument("--mode", choices=["kserve", "deployment"], default="kserve")

    src = p.add_argument_group("model source (exactly one; target/ and draft/ under one prefix unless --target-uri)")
    src.add_argument("--data-connection", metavar="SECRET", help="OpenShift AI data connection (S3 Secret) name")
    src.add_argument("--path", help="prefix in the connection's bucket, or sub-path of --pvc")
    src.add_argument("--storage-uri", metavar="URI", help="one storageUri holding target/ and draft/ (kserve)")
    src.add_argument("--target-uri", metavar="URI", help="target URI (with --draft-uri: KServe >= 0.16 storageUris)")
    src.add_argument("--draft-uri", metavar="URI")
    src.add_argument("--pvc", metavar="CLAIM", help="PersistentVolumeClaim holding target/ and draft/")
    src.add_argument("--service-account", help="service account with the S3 credentials (--storage-uri/--target-uri)")

    srv = p.add_argument_group("serving")
    srv.add_argument("--num-speculative-tokens", "-k", type=int, help="K (default: the chart's, or the schedule's)")
    srv.add_argument("--schedule", metavar="PATH",
                     help="the speculation schedule the evaluation chose: its schedule.json, or the evaluate output "
                          "directory holding one (K per batch size; no draft where it measured none faster)")
    srv.add_argument("--draft-fingerprint", metavar="ID",
                     help="names the draft on the pods and as a served model name: its fingerprint (`peagle draft "
                          "fingerprint`; default: read from the draft at --draft-uri or --storage-uri, else the "
                          "chart's hash of the model source and K)")
    srv.add_argument("--gpus", type=int, help="GPUs per replica (0 = CPU)")
    srv.add_argument("--tensor-parallel-size", type=int)
    srv.add_argument("--draft-tensor-parallel-size", type=int, help="1 or the target's tensor-parallel size")
    srv.add_argument("--max-model-len", type=int)
    srv.add_argument("--image", help="vLLM image [REGISTRY[:PORT]/]PATH:TAG, or ...@sha256:DIGEST")
    srv.add_argument("--capture", metavar="URI",
                     help="capture served traffic into this log root: s3://bucket/prefix (with --capture-secret), "
                          "or a path where capture.pvc.claimName is mounted (--set); off by default")
    srv.add_argument("--capture-secret", metavar="SECRET",
                     help="Secret with the capture's S3 credentials, e.g. an OpenShift AI data connection")
    srv.add_argument("--vllm-arg", dest="extra_args", action="append", default=[], metavar="FLAG",
                     help="extra vLLM flag, e.g. --vllm-arg=--enforce-eager (repeatable)")
    srv.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                     help="chart values file (repeatable)")
    srv.add_argument(f"--{chart_set_prefix}set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help="chart value in helm --set syntax (repeatable)")
    srv.add_argument(f"--{chart_set_prefix}set-json", dest="set_jsons", action="append", default=[],
                     metavar="KEY=JSON",
                     help="chart value as JSON, as helm --set-json (repeatable): numbers that are not whole, "
                          f"e.g. capture.sampleRate=0.1 (--{chart_set_prefix}set passes them as strings)")
    srv.add_argument("--chart", help="chart directory (default: charts/peagle-serving)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="peagle deploy",
        description="Serve a run's target + P-EAGLE draft on Kubernetes with vLLM (KServe, or a plain Deployment).")
    add_release_flags(p)
    run = p.add_argument_group("apply")
    run.add_argument("--render-only", metavar="DIR", help="write the manifests to DIR instead of applying them")
    run.add_argument("--timeout", type=float, default=1800, help="seconds to wait for Ready (default 1800)")
    run.add_argument("--no-smoke-test", action="store_true", help="skip the test chat request")
    run.add_argument("--endpoint", help="URL for the test request when the reported one is not reachable from here")
    run.add_argument("--token-env", default="PEAGLE_DEPLOY_TOKEN",
                     help="environment variable holding a bearer token for the test request (auth-enabled endpoints)")
    run.add_argument("--insecure", action="store_true", help="do not verify the endpoint's TLS certificate")
    run.add_argument("--kubeconfig")
    run.add_argument("--context")
    return p


def _namespace(ns: argparse.Namespace) -> str:
    return ns.namespace or current_namespace()


def values_from_args(ns: argparse.Namespace) -> dict:
    import helm_python as helm

    from ..config import load_yaml_mapping

    extra = [load_yaml_mapping(f, "values file") for f in ns.values]
    extra += [helm.parse_set_json(s) for s in ns.set_jsons]  # Helm's order: --set wins over --set-json
    extra += [helm.parse_set_string(s) for s in ns.sets]
    return values_for(
        mode=ns.mode, data_connection=ns.data_connection, path=ns.path, storage_uri=ns.storage_uri,
        target_uri=ns.target_uri, draft_uri=ns.draft_uri, pvc=ns.pvc, service_account=ns.service_account,
        num_speculative_tokens=ns.num_speculative_tokens, draft_fingerprint=served_draft_fingerprint(ns),
        gpus=ns.gpus, tensor_parallel_size=ns.tensor_parallel_size,
        draft_tensor_parallel_size=ns.draft_tensor_parallel_size, image=ns.image, max_model_len=ns.max_model_len,
        capture_uri=ns.capture, capture_secret=ns.capture_secret, extra_args=ns.extra_args, extra_values=extra,
        schedule=_schedule(ns.schedule))


def served_draft_fingerprint(ns: argparse.Namespace, err=None) -> str | None:
    """``--draft-fingerprint``, else the fingerprint of the draft the flags serve, read from ``--draft-uri`` or
    ``<--storage-uri>/draft`` (its manifest; nothing downloaded); None when the draft is out of reach from here
    (a data connection's or a claim's): the chart then names the rollout by a hash of its values, and says so."""
    if ns.draft_fingerprint:
        return ns.draft_fingerprint
    location = ns.draft_uri or (join(ns.storage_uri, "draft") if ns.storage_uri else None)
    if location:
        try:
            return identify_draft(location).fingerprint
        except (PeagleError, OSError) as exc:
            print(f"peagle: note: the draft's fingerprint could not be read from {location} ({exc})",
                  file=err or sys.stderr)
    print("peagle: note: the pods are labelled with the chart's hash of the model source, not the draft's "
          "fingerprint: `peagle rollout` finds a stable's records by its label -- pass --draft-fingerprint "
          "\"$(peagle draft fingerprint DRAFT)\" to roll out from this release", file=err or sys.stderr)
    return None


def _schedule(path: str | None):
    if not path:
        return None
    from ..speed import SpeculationSchedule

    return SpeculationSchedule.read(path)


def deploy(objs: list[dict], apis: Apis, *, timeout: float, smoke_test: bool = True,
           endpoint_override: str | None = None, token: str | None = None, verify_tls: bool = True,
           interval: float = 10, out=None) -> str:
    """Apply ``objs``, wait until the new rollout serves, optionally send one chat request; returns the endpoint.

    The test request goes to the served name that carries the draft fingerprint, after checking that
    the endpoint lists it: an older rollout answering fails with :class:`.smoke.SmokeTestError`."""
    out = out or sys.stdout
    for ref, action in apply(apis, objs):
        print(f"{ref} {action}", file=out)
    main_obj = next(o for o in objs if o["kind"] in ("InferenceService", "Deployment"))
    meta = main_obj["metadata"]
    fingerprint = fingerprint_of(main_obj)
    print(f"waiting up to {timeout:.0f}s for {main_obj['kind']}/{meta['name']} to serve"
          + (f" draft {fingerprint}" if fingerprint else "") + " ...", file=out, flush=True)
    ready = wait_ready(apis, main_obj["kind"], main_obj["apiVersion"], meta["name"], meta["namespace"],
                       timeout=timeout, interval=interval, fingerprint=fingerprint)
    url = endpoint_override or endpoint(apis, objs, ready)
    if smoke_test:
        names = served_names(objs) or [meta["name"]]
        model = next((n for n in names if fingerprint and n.endswith(f":draft-{fingerprint}")), names[0])
        if model != names[0]:
            require_model(url, model, token=token, verify_tls=verify_tls)
            print(f"the endpoint serves draft {fingerprint} ({model})", file=out)
        reply = chat(url, model, token=token, verify_tls=verify_tls)
        text = (reply["choices"][0].get("message") or {}).get("content", "")
        print(f"test request answered: {text[:80]!r}", file=out)
    print(f"endpoint: {url}", file=out)
    return url


def served_names(objs: list[dict]) -> list[str]:
    """The vLLM ``--served-model-name`` values of the rendered server container (``--flag=a`` or ``--flag a b``)."""
    for o in objs:
        spec = o.get("spec") or {}
        containers = spec.get("containers") or ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
        for c in containers:
            args = c.get("args") or []
            for i, a in enumerate(args):
                if a.startswith("--served-model-name="):
                    return [a.split("=", 1)[1]]
                if a == "--served-model-name":
                    names = []
                    for value in args[i + 1:]:
                        if value.startswith("-"):
                            break
                        names.append(value)
                    return names
    return []


def main(argv: list[str] | None = None, apis: Apis | None = None) -> int:
    from ..stage_io import check_writable, write_errors

    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        check_arguments(ns)
        if ns.render_only:
            check_writable(ns.render_only, directory=True)  # an existing file there: exit 2, not a traceback
        namespace = _namespace(ns)
        values = values_from_args(ns)
        objs = render(values, ns.name, namespace, ns.chart)
    except PeagleError as e:  # a bad argument or value (exit 2)
        return report(e)
    except (OSError, ValueError) as e:  # a values file that cannot be read or parsed
        print(f"peagle: error: {e}", file=sys.stderr)
        return 2
    if ns.render_only:
        try:
            with write_errors(ns.render_only, os.path.abspath(ns.render_only)):
                paths = write_manifests(objs, ns.render_only)
        except PeagleError as e:  # a full or read-only disk
            return report(e)
        for path in paths:
            print(path)
        return 0
    if apis is None:
        try:
            apis = Apis.from_environment(ns.kubeconfig, ns.context)
        except Exception as e:  # kubernetes.config.ConfigException and file errors
            print(f"peagle: error: no cluster credentials ({e})", file=sys.stderr)
            return 2
    try:
        deploy(objs, apis, timeout=ns.timeout, smoke_test=not ns.no_smoke_test, endpoint_override=ns.endpoint,
               token=os.environ.get(ns.token_env) or None, verify_tls=not ns.insecure)
    except PeagleError as e:  # DeployError, SmokeTestError: exit 1
        return report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())

