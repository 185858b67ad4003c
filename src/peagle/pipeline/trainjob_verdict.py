"""Why the TrainJob launcher gave up on a job it deleted: one small ConfigMap per TrainJob name.

The launcher deletes a job that Kueue manages when it gives up on it: left suspended, Kueue would start
it again (see :mod:`.trainjob`). The verdict that a suspended job carries in its annotations then lives in
the ConfigMap ``<trainjob>-verdict`` (:func:`verdict_name`), which the next attempt of the step reads
before it creates the job: ``timeout``, ``stuck`` and ``refused`` (:data:`TERMINAL_REASONS`) fail that
attempt at once; ``terminated`` (the step was stopped) lets it create the job again, its timeout still
counted from the first job's creation (``created``). The ConfigMap outlives the job on purpose: deleting
it lets a retry train the run anew.

Rights: ConfigMaps create, get and patch in the step's namespace (manifests/rbac-extra/trainjob). A step
without them still frees the GPUs; it says that it could not record or read the verdict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..deploy.kube import api_message, status_code, to_dict

TERMINAL_REASONS = ("timeout", "stuck", "refused")  # a later attempt fails at once; "terminated" trains again
VERDICT_SUFFIX = "-verdict"
MESSAGE_MAX = 1000


@dataclass(frozen=True)
class Verdict:
    """Why the launcher gave up on a TrainJob (``why``: timeout, stuck, refused or terminated)."""

    why: str
    message: str
    created: str = ""  # creationTimestamp of the first job of this name: the step's timeout counts from it

    @property
    def terminal(self) -> bool:
        return self.why in TERMINAL_REASONS


def verdict_name(trainjob: str) -> str:
    """The ConfigMap that holds the verdict on TrainJob ``trainjob``."""
    return trainjob + VERDICT_SUFFIX


class VerdictStore:
    """Reads and records verdicts through ``core`` (the kubernetes client's ``CoreV1Api``, or a fake)."""

    def __init__(self, core: Any, out: Callable[[str], None]):
        self.core, self.out = core, out

    def read(self, trainjob: str, namespace: str) -> Verdict | None:
        """The verdict on ``trainjob``, or None (none recorded, or unreadable: said in the log)."""
        name = verdict_name(trainjob)
        try:
            config_map = to_dict(self.core.read_namespaced_config_map(name=name, namespace=namespace))
        except Exception as exc:  # noqa: BLE001 - a step whose Role lacks ConfigMaps still trains
            if status_code(exc) != 404:
                self.out(f"(cannot read ConfigMap {namespace}/{name}: {api_message(exc)}; a verdict an earlier "
                         "attempt of this step recorded there is not checked)")
            return None
        data = config_map.get("data") or {}
        if not data.get("verdict"):
            return None
        return Verdict(data["verdict"], data.get("message", ""), data.get("created", ""))

    def record(self, trainjob: str, namespace: str, labels: dict[str, str], verdict: Verdict) -> bool:
        """Record ``verdict`` on ``trainjob`` (replacing an earlier one); False when it could not (said)."""
        name = verdict_name(trainjob)
        data = {"trainjob": trainjob, "verdict": verdict.why, "message": verdict.message[:MESSAGE_MAX],
                "created": verdict.created}
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, "labels": labels}, "data": data}
        try:
            try:
                self.core.create_namespaced_config_map(namespace=namespace, body=body)
            except Exception as exc:
                if status_code(exc) != 409:
                    raise
                # a dict: the client sends it as a strategic merge patch, which replaces these keys
                self.core.patch_namespaced_config_map(name=name, namespace=namespace, body={"data": data})
        except Exception as exc:  # noqa: BLE001 - the GPUs are freed anyway; say what a retry will do
            self.out(f"could not record why TrainJob {namespace}/{trainjob} was given up (ConfigMap {name}: "
                     f"{api_message(exc)}); a retry of this step will create the job again")
            return False
        self.out(f"recorded in ConfigMap {namespace}/{name}: {verdict.why}")
        return True
