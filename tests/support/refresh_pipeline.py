"""Arguments of the refresh pipeline's trigger component, shared by the refresh-pipeline and rollout tests."""
from __future__ import annotations


def trigger_arguments(**values):
    """Every argument of the trigger component (the pipeline's parameters at their defaults) but its outputs."""
    from peagle.pipeline.refresh_params import RefreshParams

    defaults = {n: f.default for n, f in RefreshParams.model_fields.items() if not f.is_required()}
    return {**defaults, "target": "/t", "serving_draft": "/d", "traffic": "/x", "run_name": "r1", "job_id": "job",
            "config": "", **values}
