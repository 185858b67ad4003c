"""Render the ``peagle-serving`` Helm chart into Kubernetes objects, offline (helm_python, no helm binary).

:func:`values_for` turns deploy arguments (where the run's target and draft live, K, GPUs, image) into
chart values; :func:`render` returns the objects in apply order; :func:`write_manifests` writes them
as one YAML file per object (``--render-only``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from .values import InvalidValue, check, check_capture, parse_image
from ..errors import PeagleError

CHART_NAME = "peagle-serving"
# Objects a later one refers to are applied first (the InferenceService names its ServingRuntime).
APPLY_ORDER = ("ServiceAccount", "Secret", "ConfigMap", "ServingRuntime", "Service", "Deployment",
               "InferenceService", "Route", "ServiceMonitor", "PodMonitor")


class RenderError(PeagleError, ValueError):
    """The chart could not be rendered with the given values (the message says which value)."""


def chart_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The chart directory: ``explicit``, else ``$PEAGLE_CHART_DIR``, else ``charts/peagle-serving``
    of the source tree this module lives in (the images copy the chart to the same place)."""
    candidates = [explicit, os.environ.get("PEAGLE_CHART_DIR")]
    for parent in Path(__file__).resolve().parents:
        candidates.append(parent / "charts" / CHART_NAME)
    for c in candidates:
        if c and (Path(c) / "Chart.yaml").is_file():
            return Path(c)
    raise RenderError(f"chart {CHART_NAME!r} not found: pass --chart DIR or set PEAGLE_CHART_DIR")


def _set(values: dict, dotted: str, value: Any) -> None:
    node = values
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def deep_merge(base: dict, override: Mapping) -> dict:
    """``override`` merged into a copy of ``base`` (maps recursively, everything else replaced)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def values_for(*, mode: str = "kserve", data_connection: str | None = None, path: str | None = None,
               bucket: str | None = None,
               storage_uri: str | None = None, target_uri: str | None = None, draft_uri: str | None = None,
               pvc: str | None = None, service_account: str | None = None,
               num_speculative_tokens: int | None = None, gpus: int | None = None,
               tensor_parallel_size: int | None = None, draft_tensor_parallel_size: int | None = None,
               image: str | None = None, max_model_len: int | None = None, draft_fingerprint: str | None = None,
               capture_uri: str | None = None, capture_secret: str | None = None, schedule: Any = None,
               extra_args: Iterable[str] = (), extra_values: Iterable[Mapping] = ()) -> dict:
    """Chart values for one deployment. Exactly one model source:

    * ``data_connection`` (+ ``path``, + ``bucket`` when not the connection's own): OpenShift AI data
      connection, prefix holding target/ and draft/;
    * ``storage_uri``: one URI holding target/ and draft/ (kserve mode; ``service_account`` for creds);
    * ``target_uri`` + ``draft_uri``: KServe >= 0.16 ``storageUris`` (kserve mode);
    * ``pvc`` (+ ``path``): a PersistentVolumeClaim sub-path holding target/ and draft/.

    ``draft_fingerprint`` names the draft (its fingerprint, :mod:`peagle.records.identity`); without it the
    chart derives a name of the rollout from the model source and the speculative config.
    ``capture_uri`` turns on the traffic capture into that log root (``s3://...`` with ``capture_secret``,
    the Secret holding its S3 credentials, e.g. a data connection; or a path on ``capture.pvc``).
    ``image`` is a full reference ``registry[:port]/path:tag`` (or ``...@sha256:...``), checked by
    :func:`.values.parse_image`; every other string is checked by the chart's schema at :func:`render`.
    ``schedule`` (a :class:`peagle.speed.SpeculationSchedule`, the evaluation's ``schedule.json``) sets K per
    batch size: one K everywhere as ``speculative.numSpeculativeTokens``, several as the largest K plus
    ``speculative.numSpeculativeTokensPerBatchSize``, K = 0 everywhere as ``speculative.enabled: false``
    (the target alone was measured fastest); ``num_speculative_tokens`` must then be unset or agree.
    ``extra_values`` (parsed ``-f``/``--set`` maps) are merged last and win.
    """
    sources = {"dataConnection": data_connection, "uri": storage_uri, "uris": target_uri or draft_uri, "pvc": pvc}
    chosen = [k for k, v in sources.items() if v]
    if len(chosen) != 1:
        raise RenderError("give exactly one model source: --data-connection, --storage-uri, "
                          f"--target-uri/--draft-uri or --pvc (got {chosen or 'none'})")
    kind = chosen[0]
    v: dict[str, Any] = {"mode": mode, "storage": {"type": kind}}
    if kind == "dataConnection":
        _set(v, "storage.dataConnection", {"name": data_connection, "path": path or ""})
        if bucket:
            _set(v, "storage.dataConnection.bucket", bucket)
    elif kind == "uri":
        _set(v, "storage.uri", {"uri": storage_uri, "serviceAccountName": service_account or ""})
    elif kind == "uris":
        if not (target_uri and draft_uri):
            raise RenderError("--target-uri and --draft-uri go together")
        _set(v, "storage.uris", {"target": target_uri, "draft": draft_uri,
                                 "serviceAccountName": service_account or ""})
    else:
        _set(v, "storage.pvc", {"claimName": pvc, "path": path or ""})
    if schedule is not None:
        k = schedule.num_speculative_tokens
        if num_speculative_tokens is not None and int(num_speculative_tokens) != k:
            raise RenderError(f"num_speculative_tokens {num_speculative_tokens} disagrees with the schedule "
                              f"({schedule.describe()}: K up to {k}); give one of them")
        if k == 0:
            _set(v, "speculative.enabled", False)
        else:
            _set(v, "speculative.numSpeculativeTokens", k)
            if schedule.single_k is None:
                _set(v, "speculative.numSpeculativeTokensPerBatchSize", schedule.vllm_ranges())
    elif num_speculative_tokens is not None:
        _set(v, "speculative.numSpeculativeTokens", int(num_speculative_tokens))
    if gpus is not None:
        _set(v, "gpu.count", int(gpus))
    if tensor_parallel_size is not None:
        _set(v, "vllm.tensorParallelSize", int(tensor_parallel_size))
    if draft_tensor_parallel_size is not None:
        _set(v, "speculative.draftTensorParallelSize", int(draft_tensor_parallel_size))
    if max_model_len is not None:
        _set(v, "vllm.maxModelLen", int(max_model_len))
    if draft_fingerprint:
        _set(v, "speculative.draftFingerprint", draft_fingerprint)
    if image:
        try:
            repo, tag, digest = parse_image(image)
        except InvalidValue as e:
            raise RenderError(f"image: {e}") from None
        # Both parts always: the chart's default tag must not stay next to a digest given alone.
        _set(v, "image", {"repository": repo, "tag": tag, "digest": digest})
    if capture_uri:
        _set(v, "capture", {"enabled": True, "uri": capture_uri})
    if capture_secret:
        _set(v, "capture.s3SecretName", capture_secret)
    if extra_args:
        _set(v, "vllm.extraArgs", list(extra_args))
    for extra in extra_values:
        v = deep_merge(v, extra)
    return v


def render(values: Mapping, name: str, namespace: str, chart: str | os.PathLike | None = None) -> list[dict]:
    """Render the chart; returns its objects (NOTES.txt excluded) in apply order, each with
    ``metadata.namespace`` set (Helm leaves it to the client)."""
    import helm_python as helm

    # Helm does not check the release name against what KServe accepts, nor the namespace at all.
    for what, rule, value in (("name", "objectName", name), ("namespace", "dnsLabel", namespace)):
        try:
            check(rule, value)
        except InvalidValue as e:
            raise RenderError(f"{what}: {e}") from None
    try:  # in CaptureSettings' words (the chart's schema and template say the same, less precisely)
        check_capture(values.get("capture"))
    except InvalidValue as e:
        raise RenderError(str(e)) from None
    try:
        files = helm.Chart.load(str(chart_dir(chart))).render(dict(values), name=name, namespace=namespace)
    except helm.HelmError as e:  # schema violations and template `fail`s name the value
        raise RenderError(str(e)) from None
    objs: list[dict] = []
    for path in sorted(files):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(files[path]):
            if doc:
                doc.setdefault("metadata", {})["namespace"] = namespace
                objs.append(doc)
    rank = {k: i for i, k in enumerate(APPLY_ORDER)}
    return sorted(objs, key=lambda o: rank.get(o["kind"], len(rank)))


def notes(values: Mapping, name: str, namespace: str, chart: str | os.PathLike | None = None) -> str:
    """The chart's NOTES.txt (how to reach the endpoint, a test request)."""
    import helm_python as helm

    files = helm.Chart.load(str(chart_dir(chart))).render(dict(values), name=name, namespace=namespace)
    return next((t for p, t in files.items() if p.endswith("NOTES.txt")), "")


def write_manifests(objs: Iterable[dict], out_dir: str | os.PathLike) -> list[Path]:
    """One ``NN-kind-name.yaml`` per object (NN = apply order); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(objs):
        p = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        p.write_text(yaml.safe_dump(obj, sort_keys=False))
        paths.append(p)
    return paths
