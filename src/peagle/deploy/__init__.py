"""Serving a target + P-EAGLE draft on Kubernetes: chart rendering, apply/wait, smoke test, model fetch.

* :mod:`.render` -- ``charts/peagle-serving`` -> objects (helm_python, offline);
* :mod:`.kube`   -- create-or-patch, wait for Ready, endpoint (kubernetes python client);
* :mod:`.smoke`  -- one chat request against the endpoint;
* :mod:`.fetch`  -- the plain-Deployment init container's S3 download;
* :mod:`.cli`    -- ``python -m peagle.deploy`` (``peagle deploy``).
"""
from .cli import deploy, main
from .kube import Apis, DeployError, DeployFailed, DeployTimeout
from .render import RenderError, render, values_for, write_manifests

__all__ = ["Apis", "DeployError", "DeployFailed", "DeployTimeout", "RenderError", "deploy", "main", "render",
           "values_for", "write_manifests"]
