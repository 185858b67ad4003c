"""The pipeline's deploy step (src/peagle/pipeline/deployment.py) where no chart is rendered; what it renders
is tested with the Helm SDK in tests/integration/helm/test_pipeline_deploy_helm.py."""
from __future__ import annotations

import pytest


def test_the_deploy_step_refuses_a_draft_that_is_not_published(tmp_path):
    from peagle.errors import PeagleError
    from peagle.pipeline.deployment import deploy

    run = tmp_path / "runs" / "r1"
    (run / "models" / "draft").mkdir(parents=True)
    (run / "models" / "draft" / "config.json").write_text("{}")
    with pytest.raises(PeagleError, match=r"runs/r1/models/draft/? is not published \(no _SUCCESS\)"):
        deploy(str(run), "qwen3-peagle", "render", "aws-connection-peagle", 4, "", namespace="ml")
    assert not (run / "deploy").exists()
