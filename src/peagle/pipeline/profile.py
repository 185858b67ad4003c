"""The cluster profile: everything cluster-specific, applied when the pipeline is compiled.

One YAML file (``pipelines/profiles/*.yaml``) names the images, the GPU node pool (node selector,
tolerations, accelerator resource), per-step CPU/memory/GPUs, the ``/dev/shm`` and scratch
volumes, retries, the TrainJob settings and the serving settings. :func:`apply_step` puts a
step's part on a KFP task; the compiled YAML then carries it, so one profile = one compiled
pipeline per cluster flavour. Nothing here is a credential: S3 access comes from the data
connection Secret, mounted as env by name (a pipeline parameter).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from ..config import ConfigError, StrictModel
from ..deploy.values import DnsLabel, ImageRef, LabelKey, LabelValue, Quantity, ResourceName
from .deployment import ServingSettings
from ..storage.settings import DATA_CONNECTION_DIR_ENV
from .trainjob import REQUIRED_KEYS  # OpenShift AI data-connection keys (values stay in the Secret)
from .training import TrainJobSettings

DATA_CONNECTION_MOUNT = "/var/run/secrets/peagle/data-connection"  # the Secret as files (optional keys)
STEPS = ("init_run", "regenerate", "prepare", "extract", "gpu_limit", "train", "train_launcher", "evaluate", "deploy")
SCRATCH_MOUNT = "/scratch"


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
    toleration_seconds: int | None = None

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


class StepResources(StrictModel):
    cpu: Quantity | None = Field(None, description="CPU request (and limit when cpu_limit is unset)")
    cpu_limit: Quantity | None = None
    memory: Quantity | None = Field(None, description="memory request and limit")
    gpus: int = Field(0, ge=0, description="GPUs (0: runs off the GPU pool); the train pod uses num_gpus instead")
    timeout_s: int | None = Field(None, ge=1, description="kill the step's pod after this long")


# GPU steps use the GPU pool even when a profile lists no resources for them.
DEFAULT_STEPS = {name: StepResources(gpus=1 if name in ("regenerate", "extract", "evaluate") else 0)
                 for name in STEPS}


class Retry(StrictModel):
    num_retries: int = Field(2, ge=0)
    backoff_duration: str = "60s"
    backoff_factor: float = 2.0
    backoff_max_duration: str = "3600s"


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
        "200Gi", description=f"emptyDir at {SCRATCH_MOUNT} for model downloads and temp files (null: none)")
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
        if mine is None:
            return base
        return base.model_copy(update={k: getattr(mine, k) for k in mine.model_fields_set})

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
        tj.accelerator = self.accelerator.type
        return tj

    def trainjob_json(self) -> str:
        """The TrainJob settings as the train component's ``cluster`` input (GPU pool filled in)."""
        return json.dumps(self.resolved_trainjob().model_dump(mode="json"), sort_keys=True)

    def serving_json(self) -> str:
        return json.dumps(self.serving.model_dump(mode="json"), sort_keys=True)


def load_profile(path: str | Path | None) -> ClusterProfile:
    """Read a profile YAML (None: all defaults); unknown keys are errors naming the key."""
    if path is None:
        return ClusterProfile()
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"cluster profile not found: {path}") from None
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"cluster profile {path}: {_field_errors(exc)}") from None


def _field_errors(exc: ValidationError) -> str:
    """``images.vllm: why; steps.train.cpu: why`` (pydantic's own text spans lines and links its docs)."""
    out = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<profile>"
        if e["type"] == "extra_forbidden":
            out.append(f"{where}: unknown key")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        out.append(f"{where}: {msg}" if e["type"] == "value_error" else f"{where}: {msg} (got {e.get('input')!r})")
    return "; ".join(out)


def apply_step(task: Any, step: str, profile: ClusterProfile, data_connection: Any, gpus: Any = None,
               display_name: str | None = None) -> Any:
    """Put the profile's settings for ``step`` on a KFP task.

    ``gpus``: a STRING channel (the train pod's ``num_gpus`` as text) that replaces the profile's count:
    KFP's driver reads an accelerator count placeholder as a string and silently drops a number.
    Every step: data-connection env, no caching (each step writes to the object store), retries,
    CPU/memory, scratch volume. GPU steps: accelerator type and limit, node selector, tolerations,
    ``/dev/shm``.
    """
    from kfp import kubernetes

    r = profile.step(step)
    if display_name:
        task.set_display_name(display_name)
    task.set_caching_options(False)
    if profile.retry.num_retries:
        task.set_retry(num_retries=profile.retry.num_retries, backoff_duration=profile.retry.backoff_duration,
                       backoff_factor=profile.retry.backoff_factor,
                       backoff_max_duration=profile.retry.backoff_max_duration)
    if r.cpu:
        task.set_cpu_request(r.cpu).set_cpu_limit(r.cpu_limit or r.cpu)
    if r.memory:
        task.set_memory_request(r.memory).set_memory_limit(r.memory)
    kubernetes.use_secret_as_env(task, secret_name=data_connection,
                                 secret_key_to_env={k: k for k in REQUIRED_KEYS})
    # Optional keys (AWS_DEFAULT_REGION) come from the Secret mounted as files: KFP backends before
    # 2.15 ignore `optional` on secret env, and a missing key would then stop the pod from starting.
    kubernetes.use_secret_as_volume(task, secret_name=data_connection, mount_path=DATA_CONNECTION_MOUNT)
    task.set_env_variable(DATA_CONNECTION_DIR_ENV, DATA_CONNECTION_MOUNT)
    if profile.scratch_size:
        kubernetes.empty_dir_mount(task, volume_name="scratch", mount_path=SCRATCH_MOUNT,
                                   size_limit=profile.scratch_size)
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
    if r.timeout_s:
        kubernetes.set_timeout(task, r.timeout_s)
    return task
