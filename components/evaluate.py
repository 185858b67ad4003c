"""evaluate: vLLM-measured acceptance of the draft, report to <run>/evaluate/ and to KFP; the gate."""
from kfp.dsl import HTML, Artifact, Metrics, Output

IMAGE = "vllm"


def evaluate(run_uri: str, draft_uri: str, metrics: Output[Metrics], report: Output[HTML],
             evaluation: Output[Artifact]) -> bool:
    """Returns True when the acceptance length reaches the run's min_acceptance_length (deploy gate);
    ``evaluation``: lineage pointer to <run>/evaluate/."""
    from peagle.pipeline.evaluation import evaluate as step
    from peagle.pipeline.lineage import record

    passed = step(run_uri, draft_uri, metrics=metrics, html=report).passed
    record(evaluation, run_uri, "evaluate", passed=bool(passed))
    return passed
