"""evaluate: vLLM-measured acceptance of the draft, report to <run>/evaluate/ and to KFP; the gate."""
from kfp.dsl import HTML, Metrics, Output

IMAGE = "vllm"


def evaluate(run_uri: str, draft_uri: str, metrics: Output[Metrics], report: Output[HTML]) -> bool:
    """Returns True when the acceptance length reaches the run's min_acceptance_length (deploy gate)."""
    from peagle.pipeline.evaluation import evaluate as step

    return step(run_uri, draft_uri, metrics=metrics, html=report).passed
