"""The cluster profile: everything cluster-specific, applied when the pipeline is compiled.

One YAML file (``pipelines/profiles/*.yaml``) names the images, the GPU node pool (node selector,
tolerations, accelerator resource), per-step CPU/memory/GPUs, the ``/dev/shm`` and scratch
volumes, retries, deadlines, the TrainJob settings and the serving settings. :func:`apply_step` puts
a step's part on a KFP task; the compiled YAML then carries it, so one profile = one compiled
pipeline per cluster flavour. Nothing here is a credential: S3 access comes from the data
connection Secret, mounted as files by name (a pipeline parameter; see :mod:`.connection`).

Every field the compiled IR carries for a step is one a Kubeflow Pipelines 2.5 backend knows: its
compiler parses a step's Kubernetes config strictly to read pod labels and annotations, and drops them
all on one field it does not know (``tests/unit/pipeline/test_pipeline_compile.py`` checks against the 2.5 schema).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from ..config import MAX_DURATION_S, ConfigError, StrictModel, load_yaml_mapping, short_repr, shorten
from ..deploy.render import deep_merge
from ..deploy.values import (DnsLabel, DnsSubdomain, ImageRef, InvalidValue, LabelKey, LabelValue, Quantity,
                             ResourceName, check)
from .deployment import ServingSettings
from ..storage.settings import DATA_CONNECTION_DIR_ENV
from .trainjob import QUEUE_LABEL
from .training import TrainJobSettings

DATA_CONNECTION_MOUNT = "/var/run/secrets/peagle/data-connection"  # the Secret as files (optional keys)
STEPS = ("init_run", "regenerate", "prepare", "extract", "gpu_limit", "train", "train_launcher", "evaluate", "deploy",
         "trigger", "rollout")
SCRATCH_MOUNT = "/scratch"
IN_PROCESS_RETRY = ("extract",)  # retried by the component itself: KFP ignores retries inside a ParallelFor
# A step that waits for something with its own timeout outlives it by this much, so that it is the step,
# not Kubernetes, that gives up (and, for the TrainJob launcher, suspends the job).
LAUNCHER_MARGIN_S = 3600
DEPLOY_MARGIN_S = 1800
# The refresh's rollout step waits for a canary to serve, watches it for the canary window, then waits for the
# promoted stable to serve; this margin is for the rest (the poll after the window ends, traffic weights, the
# canary's removal, the registry and the loop history).
ROLLOUT_MARGIN_S = 1800
# OpenShift AI's profile annotations (3.x hardware profile, 2.x accelerator profile), with the rule the
# serving chart's kserve.hardwareProfile applies to each value.
HARDWARE_PROFILE_NAME = "opendatahub.io/hardware-profile-name"
HARDWARE_PROFILE_NAMESPACE = "opendatahub.io/hardware-profile-namespace"
ACCELERATOR_NAME = "opendatahub.io/accelerator-name"
_PROFILE_ANNOTATIONS = {HARDWARE_PROFILE_NAME: "dnsSubdomain", HARDWARE_PROFILE_NAMESPACE: "dnsLabel",
                        ACCELERATOR_NAME: "dnsSubdomain"}
# odh-model-controller (internal/webhook/serving/hardwareprofile/resolver.go, ProfileRef) looks a hardware profile
# up in the namespace its annotation names, else in the object's own (the project's), and refuses the object at
# admission when the profile is not there: a global profile lives in the dashboard's namespace.
HARDWARE_PROFILE_NAMESPACE_WHY = ("OpenShift AI 3.x looks a profile named alone up in the project and refuses the "
                                  "InferenceService at admission")
HARDWARE_PROFILE_NAMESPACES = "redhat-ods-applications (OpenShift AI) or opendatahub (Open Data Hub)"


_SECONDS_PER_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_UNIT_WORDS = {"s": ("s", "sec", "secs", "second", "seconds"), "m": ("m", "min", "mins", "minute", "minutes"),
               "h": ("h", "hr", "hrs", "hour", "hours"), "d": ("d", "day", "days"), "w": ("w", "week", "weeks")}
_UNITS = {word: _SECONDS_PER_UNIT[unit] for unit, words in _UNIT_WORDS.items() for word in words}
_DURATION = re.compile(r"\s*([0-9]{1,12})\s*([A-Za-z]+)\s*")


def _duration(value: Any) -> str:
    """A KFP duration as ``"<seconds>s"``, from whole seconds (a number) or ``<whole number><unit>`` with unit
    s, m, h, d or w (``"60s"``, ``"5 min"``, ``"1h"``: KFP's own forms); at most :data:`MAX_DURATION_S`."""
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) and value == int(value):
            seconds = int(value)
    elif isinstance(value, str):
        m = _DURATION.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            seconds = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if seconds is None or seconds < 0:
        raise ValueError(f"{short_repr(value)} is not a duration (whole seconds, or a whole number with unit "
                         "s, m, h, d or w, e.g. '60s', '5m', '1h')")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{short_repr(value)} is longer than {MAX_DURATION_S} seconds (366 days)")
    return f"{seconds}s"


Duration = Annotated[str, BeforeValidator(_duration)]


class Images(StrictModel):
    """Container images by role (see images/README.md)."""

    base: ImageRef = Field("quay.io/peagle/peagle-base:0.1.0-cpu",
                           description="init_run, prepare, deploy, the TrainJob launcher")
    vllm: ImageRef = Field("quay.io/peagle/peagle-vllm:0.1.0", description="regenerate, extract, evaluate")
    trainer: ImageRef = Field("quay.io/peagle/peagle-trainer:0.1.0",
                              description="train (pod mode) and the TrainJob's nodes")


class Toleration(StrictModel):
    key: LabelKey | None = None
    operator: Literal["Equal", "Exists"] | None = None
    value: LabelValue | None = None
    effect: Literal["NoExecute", "NoSchedule", "PreferNoSchedule"] | None = None
    toleration_seconds: int | None = Field(None, ge=0, le=MAX_DURATION_S)

    def as_k8s(self) -> dict[str, Any]:
        out = {"key": self.key, "operator": self.operator, "value": self.value, "effect": self.effect,
               "tolerationSeconds": self.toleration_seconds}
        return {k: v for k, v in out.items() if v is not None}


class Accelerator(StrictModel):
    """The GPU node pool."""

    type: ResourceName = Field("nvidia.com/gpu", description="extended resource name of the GPUs")
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    tolerations: list[Toleration] = Field(
        default_factory=lambda: [Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")])
    queue_name: str = Field("", pattern=r"^([a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?)?$", description=(
        "Kueue LocalQueue of the pool's GPU workloads: label kueue.x-k8s.io/queue-name on the pipeline's GPU "
        "steps, on the TrainJob (unless trainjob.queue_name names another) and on the serving objects (chart "
        "value kueue.queueName, unless serving.values sets it; not when serving.gpus is 0); empty: not queued "
        "by Kueue"))
    annotations: dict[LabelKey, str] = Field(default_factory=dict, description=(
        "annotations of the pipeline's GPU step pods, e.g. OpenShift AI's hardware profile "
        "(opendatahub.io/hardware-profile-name and -namespace, 3.x) or accelerator profile "
        "(opendatahub.io/accelerator-name, 2.x). A hardware or accelerator profile named here also goes on "
        "the InferenceService (chart value kserve.hardwareProfile, unless serving.values sets it; the 3.x one "
        "when both are named)"))

    @field_validator("annotations")
    @classmethod
    def _profile_names(cls, v: dict[str, str]) -> dict[str, str]:
        """A hardware/accelerator profile name the serving chart (and Kubernetes) would refuse fails here, and
        so does a hardware profile named without its namespace (see :data:`HARDWARE_PROFILE_NAMESPACE_WHY`)."""
        for key, rule in _PROFILE_ANNOTATIONS.items():
            if key in v:
                try:
                    check(rule, v[key])
                except InvalidValue as e:
                    raise ValueError(f"{key}: {e}") from None
        if v.get(HARDWARE_PROFILE_NAME) and not v.get(HARDWARE_PROFILE_NAMESPACE):
            raise ValueError(f"{HARDWARE_PROFILE_NAME} {shorten(v[HARDWARE_PROFILE_NAME], 64)!r} needs "
                             f"{HARDWARE_PROFILE_NAMESPACE} ({HARDWARE_PROFILE_NAMESPACE_WHY}): its namespace, e.g. "
                             f"{HARDWARE_PROFILE_NAMESPACES}")
        return v

    def hardware_profile(self) -> dict[str, str] | None:
        """The serving chart's ``kserve.hardwareProfile`` for the profile the annotations name, else None."""
        a = self.annotations
        if a.get(HARDWARE_PROFILE_NAME):
            return {"kind": "hardwareProfile", "name": a[HARDWARE_PROFILE_NAME],
                    "namespace": a[HARDWARE_PROFILE_NAMESPACE]}
        if a.get(ACCELERATOR_NAME):
            return {"kind": "acceleratorProfile", "name": a[ACCELERATOR_NAME], "namespace": ""}
        return None


class StepResources(StrictModel):
    cpu: Quantity | None = Field(None, description="CPU request (and limit when cpu_limit is unset)")
    cpu_limit: Quantity | None = None
    memory: Quantity | None = Field(None, description="memory request and limit")
    gpus: int = Field(0, ge=0, description="GPUs (0: runs off the GPU pool); the train pod uses num_gpus instead")
    timeout_s: int = Field(86400, ge=1, le=MAX_DURATION_S, description=(
        "deadline of the step's pod (activeDeadlineSeconds): Kubernetes fails it this long after it started; "
        "each retry is a new pod"))
    scratch: bool = Field(False, description=f"a scratch volume at {SCRATCH_MOUNT} (model downloads, temp files)")


_H = 3600
SCRATCH_STEPS = ("init_run", "regenerate", "prepare", "extract", "train", "evaluate")  # the steps that fetch models
# The refresh pipeline's own steps fetch no model and run off the GPU pool, so they come with small CPU and
# memory defaults (request = limit for memory); both hold traffic records in memory (the trigger the log's,
# the rollout the canary window's), so a profile raises memory for a busy endpoint.
_SMALL_STEPS = {"trigger": {"cpu": "1", "cpu_limit": "2", "memory": "4Gi"},
                "rollout": {"cpu": "500m", "cpu_limit": "1", "memory": "2Gi"}}
# GPU steps use the GPU pool even when a profile lists no resources for them. train_launcher's and
# deploy's deadlines follow trainjob.timeout_s and serving.timeout_s (ClusterProfile.step).
DEFAULT_STEPS = {name: StepResources(gpus=1 if name in ("regenerate", "extract", "evaluate") else 0,
                                     scratch=name in SCRATCH_STEPS, timeout_s=timeout, **_SMALL_STEPS.get(name, {}))
                 for name, timeout in (("init_run", 6 * _H), ("regenerate", 24 * _H), ("prepare", 6 * _H),
                                       ("extract", 24 * _H), ("gpu_limit", 900), ("train", 24 * _H),
                                       ("train_launcher", 25 * _H), ("evaluate", 12 * _H), ("deploy", _H),
                                       # the refresh's trigger: reads the traffic log and the loop history,
                                       # fingerprints the target, validates the settings
                                       ("trigger", 2 * _H),
                                       # the refresh's rollout: must outlive rollout_deadline_needed (checked
                                       # against the run's settings by check_rollout_deadline)
                                       ("rollout", 12 * _H))}


def rollout_deadline_needed(window_s: float, ready_timeout_s: float, poll_s: float) -> int:
    """Seconds the refresh's rollout step may need: a wait for the canary to serve, the canary window and
    its last poll, a wait for the promoted stable to serve, and :data:`ROLLOUT_MARGIN_S`."""
    return math.ceil(window_s + poll_s + 2 * ready_timeout_s) + ROLLOUT_MARGIN_S


def check_rollout_deadline(window_s: float, ready_timeout_s: float, poll_s: float, timeout_s: int) -> None:
    """Refuse rollout settings the rollout step's deadline (the cluster profile's ``steps.rollout.timeout_s``,
    ``timeout_s``) cannot hold: Kubernetes would kill the step mid-canary, before it decides (ConfigError
    naming both settings and their values)."""
    needed = rollout_deadline_needed(window_s, ready_timeout_s, poll_s)
    if needed > timeout_s:
        raise ConfigError(
            f"rollout.window_s={window_s:g} (the refresh's rollout_window_s) does not fit the rollout step's "
            f"deadline: the cluster profile's steps.rollout.timeout_s={timeout_s} must hold rollout.window_s + "
            f"rollout.poll_s={poll_s:g} + 2 x rollout.ready_timeout_s={ready_timeout_s:g} (the canary and the "
            f"promoted stable each waited for) + {ROLLOUT_MARGIN_S} s = {needed} s: shorten rollout.window_s (or "
            f"rollout.ready_timeout_s), or compile the refresh pipeline with a profile whose steps.rollout.timeout_s "
            f"is at least {needed}")


class Retry(StrictModel):
    """Attempts after a failure: KFP's retry of a step's pod, and extract's own attempts in its process
    (KFP ignores retries inside a ParallelFor)."""

    num_retries: int = Field(2, ge=0, le=100)
    backoff_duration: Duration = Field("60s", description="wait before the first retry (seconds or e.g. '1m')")
    backoff_factor: float = Field(2.0, gt=0, le=100, description="each further wait is this many times longer")
    backoff_max_duration: Duration = Field("3600s", description="retry for at most this long")


class ClusterProfile(StrictModel):
    """See the module docstring; every field has a default, a profile file overrides what differs."""

    name: DnsLabel = Field("default", description="names the compiled file pipelines/compiled/peagle-<name>.yaml")
    images: Images = Field(default_factory=Images)
    install_kfp_package: bool = Field(
        False, description="pip-install kfp in each step's pod at start (the images of images/ ship it; true for "
        "images without it, at the price of a package index and a slower start)")
    accelerator: Accelerator = Field(default_factory=Accelerator)
    shm_size: Quantity = Field("16Gi", description="/dev/shm (memory-backed emptyDir) on GPU steps, for NCCL")
    scratch_size: Quantity | None = Field(
        "200Gi", description=f"size of the scratch volume at {SCRATCH_MOUNT} (model downloads and temp files) of the "
        "steps with scratch: a generic ephemeral volume, a claim of this size made with the pod (null: none)")
    scratch_storage_class: DnsSubdomain | None = Field(
        None, description="StorageClass of the scratch volume's claim (null: the cluster's default class)")
    steps: dict[str, StepResources] = Field(default_factory=dict)
    retry: Retry = Field(default_factory=Retry)
    extract_parallelism: int = Field(0, ge=0, description="extraction workers at once (0: all shards)")
    train_beside_extract: bool = Field(
        False, description="start training right after prepare, beside the extraction workers, instead of after "
        "them: for runs with train.data_mode=streaming (the trainer reads each shard set as it is published). "
        "kfp.local runs one task at a time, so the local profile keeps training after extraction")
    trainjob: TrainJobSettings = Field(default_factory=TrainJobSettings)
    serving: ServingSettings = Field(default_factory=ServingSettings)

    def step(self, name: str) -> StepResources:
        """The step's resources: the profile's entry, key by key over :data:`DEFAULT_STEPS`."""
        if name not in STEPS:
            raise KeyError(f"unknown step {name!r}; expected one of {STEPS}")
        base = DEFAULT_STEPS[name]
        mine = self.steps.get(name)
        derived = self._derived_timeout(name)
        if derived and not (mine and "timeout_s" in mine.model_fields_set):
            base = base.model_copy(update={"timeout_s": derived})
        if mine is None:
            return base
        return base.model_copy(update={k: getattr(mine, k) for k in mine.model_fields_set})

    def _derived_timeout(self, name: str) -> int | None:
        """The deadline of a step that waits with its own timeout: that timeout plus a margin."""
        inner = {"train_launcher": (self.trainjob.timeout_s, LAUNCHER_MARGIN_S),
                 "deploy": (self.serving.timeout_s, DEPLOY_MARGIN_S)}.get(name)
        return min(MAX_DURATION_S, math.ceil(inner[0]) + inner[1]) if inner else None

    @model_validator(mode="after")
    def _deadlines_outlive_inner_timeouts(self) -> "ClusterProfile":
        for step, inner, setting in (("train_launcher", self.trainjob.timeout_s, "trainjob.timeout_s"),
                                     ("deploy", self.serving.timeout_s, "serving.timeout_s")):
            mine = self.steps.get(step)
            if mine is not None and "timeout_s" in mine.model_fields_set and mine.timeout_s <= inner:
                raise ValueError(f"steps.{step}.timeout_s ({mine.timeout_s}) must be longer than {setting} "
                                 f"({inner:g}): the step gives up at {setting} and cleans up, which it cannot do "
                                 "once Kubernetes has killed its pod")
        return self

    @field_validator("steps")
    @classmethod
    def _known_steps(cls, v: dict[str, StepResources]) -> dict[str, StepResources]:
        unknown = sorted(set(v) - set(STEPS))
        if unknown:
            raise ValueError(f"unknown steps {unknown}; expected some of {list(STEPS)}")
        return v

    def resolved_trainjob(self) -> TrainJobSettings:
        """The TrainJob settings with the GPU pool filled in from ``accelerator`` where unset."""
        tj = self.trainjob.model_copy(deep=True)
        if not tj.node_selector:
            tj.node_selector = dict(self.accelerator.node_selector)
        if not tj.tolerations:
            tj.tolerations = [t.as_k8s() for t in self.accelerator.tolerations]
        if not tj.queue_name:
            tj.queue_name = self.accelerator.queue_name
        tj.accelerator = self.accelerator.type
        return tj

    def trainjob_json(self) -> str:
        """The TrainJob settings as the train component's ``cluster`` input (GPU pool filled in)."""
        return json.dumps(self.resolved_trainjob().model_dump(mode="json"), sort_keys=True)

    def resolved_serving(self) -> ServingSettings:
        """The serving settings with the GPU pool filled in as chart values: its Kueue queue
        (``kueue.queueName``) and the OpenShift AI profile its annotations name (``kserve.hardwareProfile``),
        under ``serving.values``, which win. Serving with 0 GPUs per replica is no GPU workload: left as is."""
        s = self.serving.model_copy(deep=True)
        gpu = s.values.get("gpu")
        gpus = gpu["count"] if isinstance(gpu, dict) and "count" in gpu else s.gpus  # None: the chart's (1)
        if gpus == 0:
            return s
        pool: dict[str, Any] = {}
        if self.accelerator.queue_name:
            pool["kueue"] = {"queueName": self.accelerator.queue_name}
        hardware = self.accelerator.hardware_profile()
        if hardware:
            pool["kserve"] = {"hardwareProfile": hardware}
        s.values = deep_merge(pool, s.values)
        return s

    def swap_token_secret(self) -> tuple[str, str] | None:
        """(Secret, key) of the swap endpoint's token when the serving values enable the draft swap (chart
        ``swap.enabled``, ``swap.tokenSecret``): the refresh's rollout step gets it as ``PEAGLE_SWAP_TOKEN``
        to promote by swap (:func:`peagle.rollout.assemble.pod_swap`); None otherwise."""
        swap = self.serving.values.get("swap")
        if not isinstance(swap, dict) or not swap.get("enabled"):
            return None
        secret = swap.get("tokenSecret") or {}
        if not isinstance(secret, dict) or not secret.get("name"):
            raise ConfigError("serving.values.swap.enabled: swap.tokenSecret.name is required (the Secret holding the "
                              "swap endpoint's bearer token)")
        return str(secret["name"]), str(secret.get("key") or "token")

    def serving_json(self) -> str:
        """The serving settings as the deploy component's ``serving`` input (GPU pool filled in)."""
        return json.dumps(self.resolved_serving().model_dump(mode="json"), sort_keys=True)


def load_profile(path: str | Path | None) -> ClusterProfile:
    """Read a profile YAML (None: all defaults); unknown keys are errors naming the key. Errors name the
    file and never quote it (``--profile`` may name any file: only a mapping is read as a profile)."""
    if path is None:
        return ClusterProfile()
    data = load_yaml_mapping(path, "cluster profile")
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"cluster profile {path}: {_field_errors(exc)}") from None


def _field_errors(exc: ValidationError) -> str:
    """``images.vllm: why; steps.train.cpu: why`` (pydantic's own text spans lines and links its docs)."""
    out = []
    errors = exc.errors()
    for e in errors[:10]:
        where = shorten(".".join(str(p) for p in e["loc"]) or "<profile>", 120)
        if e["type"] == "extra_forbidden":
            out.append(f"{where}: unknown key")
            continue
        msg = shorten(e["msg"].removeprefix("Value error, "), 300)
        got = "" if e["type"] == "value_error" else f" (got {short_repr(e.get('input'))})"
        out.append(f"{where}: {msg}{got}")
    if len(errors) > 10:
        out.append(f"{len(errors) - 10} more errors")
    return "; ".join(out)


def apply_step(task: Any, step: str, profile: ClusterProfile, data_connection: Any, gpus: Any = None,
               display_name: str | None = None) -> Any:
    """Put the profile's settings for ``step`` on a KFP task.

    ``gpus``: a STRING channel (the train pod's ``num_gpus`` as text) that replaces the profile's count:
    KFP's driver reads an accelerator count placeholder as a string and silently drops a number.
    Every step: the data connection mounted as files, no caching (each step writes to the object store),
    retries (but :data:`IN_PROCESS_RETRY`), CPU/memory, a deadline. Steps with ``scratch``: the scratch
    volume. GPU steps: accelerator type and limit, node selector, tolerations, ``/dev/shm``, the Kueue
    queue label and the pool's annotations.
    """
    from kfp import kubernetes

    r = profile.step(step)
    if display_name:
        task.set_display_name(display_name)
    task.set_caching_options(False)
    if profile.retry.num_retries and step not in IN_PROCESS_RETRY:
        task.set_retry(num_retries=profile.retry.num_retries, backoff_duration=profile.retry.backoff_duration,
                       backoff_factor=profile.retry.backoff_factor,
                       backoff_max_duration=profile.retry.backoff_max_duration)
    if r.cpu:
        task.set_cpu_request(r.cpu).set_cpu_limit(r.cpu_limit or r.cpu)
    if r.memory:
        task.set_memory_request(r.memory).set_memory_limit(r.memory)
    # Every connection key comes from the Secret as files, never as required env: a key the Secret lacks
    # (a connection without a Bucket) would hold the pod in CreateContainerConfigError for ever. Optional,
    # so that even a missing Secret reaches init_run's check, which names it.
    kubernetes.use_secret_as_volume(task, secret_name=data_connection, mount_path=DATA_CONNECTION_MOUNT, optional=True)
    task.set_env_variable(DATA_CONNECTION_DIR_ENV, DATA_CONNECTION_MOUNT)
    if profile.scratch_size and r.scratch:
        kubernetes.add_ephemeral_volume(task, volume_name="scratch", mount_path=SCRATCH_MOUNT,
                                        access_modes=["ReadWriteOnce"], size=profile.scratch_size,
                                        storage_class_name=profile.scratch_storage_class)
        task.set_env_variable("PEAGLE_CACHE", f"{SCRATCH_MOUNT}/cache")
        task.set_env_variable("TMPDIR", SCRATCH_MOUNT)
    if gpus is not None or r.gpus:
        task.set_accelerator_type(profile.accelerator.type)
        task.set_accelerator_limit(gpus if gpus is not None else r.gpus)
        for key, value in profile.accelerator.node_selector.items():
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        for t in profile.accelerator.tolerations:
            kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect,
                                      toleration_seconds=t.toleration_seconds)
        kubernetes.empty_dir_mount(task, volume_name="shm", mount_path="/dev/shm", medium="Memory",
                                   size_limit=profile.shm_size)
        if profile.accelerator.queue_name:
            kubernetes.add_pod_label(task, label_key=QUEUE_LABEL, label_value=profile.accelerator.queue_name)
        for key, value in profile.accelerator.annotations.items():
            kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    kubernetes.set_timeout(task, r.timeout_s)
    return task
