"""What a TrainJob's state says, read by the launcher (:mod:`.trainjob`): its ``Complete`` / ``Failed``
conditions, Trainer v2.0's refusal to build its JobSet, the launcher's own suspension of it (the
annotations that say why), the Kueue LocalQueue that manages it, whether it is being deleted, and the
trouble of a pod that does not end by itself.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Set by the launcher when it suspends a TrainJob: why (timeout, stuck, refused, terminated) and the message.
# (A job Kueue manages is deleted instead; its verdict goes into a ConfigMap: .trainjob_verdict.)
SUSPENDED_ANNOTATION = "peagle.io/suspended-by-launcher"
SUSPENDED_MESSAGE_ANNOTATION = "peagle.io/suspended-message"
# Pod states that do not end by themselves. ErrImagePull and ImagePullBackOff alternate: one category.
STUCK_WAITING = {"CreateContainerConfigError": "config", "ErrImagePull": "image", "ImagePullBackOff": "image",
                 "InvalidImageName": "image"}
REFUSED_REASONS = ("JobsBuildFailed", "JobsCreationFailed")  # Trainer v2.0's Created=False reasons


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The ``kind`` condition of a TrainJob when its status is "True", else None."""
    for c in ((obj.get("status") or {}).get("conditions") or []):
        if c.get("type") == kind and str(c.get("status")) == "True":
            return c
    return None


def refusal(obj: dict[str, Any]) -> dict[str, Any] | None:
    """Trainer v2.0's ``Created=False`` condition saying the JobSet could not be built or created."""
    for c in ((obj.get("status") or {}).get("conditions") or []):
        if c.get("type") == "Created" and str(c.get("status")) == "False" and c.get("reason") in REFUSED_REASONS:
            return c
    return None


def suspension(obj: dict[str, Any]) -> tuple[str, str] | None:
    """(why, message) when the launcher suspended ``obj`` and it is still suspended, else None."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    why = annotations.get(SUSPENDED_ANNOTATION)
    if why and (obj.get("spec") or {}).get("suspend"):
        return why, annotations.get(SUSPENDED_MESSAGE_ANNOTATION, "")
    return None


def kueue_queue(obj: dict[str, Any]) -> str:
    """The Kueue LocalQueue that manages ``obj`` -- its :data:`QUEUE_LABEL` label, what Kueue reads
    (upstream pkg/controller/jobframework/utils.go, ``QueueNameForObject``) -- else ""."""
    return ((obj.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or ""


def being_deleted(obj: dict[str, Any]) -> bool:
    """Deleted, and waiting for its dependents (Foreground) or finalizers to go."""
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def pod_trouble(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a pod in a state that does not end by itself (:data:`STUCK_WAITING`, or
    Pending and unschedulable), else None."""
    status = pod.get("status") or {}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING:
            return waiting["reason"], waiting.get("message") or ""
    if status.get("phase", "Pending") == "Pending":
        for c in status.get("conditions") or []:
            if (c.get("type"), str(c.get("status")), c.get("reason")) == ("PodScheduled", "False", "Unschedulable"):
                return "Unschedulable", c.get("message") or ""
    return None


def timestamp_seconds(text: str | None) -> float | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp() if text else None
    except ValueError:
        return None
