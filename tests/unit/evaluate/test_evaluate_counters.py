"""Spec-decode counters: Prometheus text and ``LLM.get_metrics()`` objects through one normaliser."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from peagle.evaluate.counters import (
    CounterError,
    SpecDecodeCounts,
    counts_from_prometheus_text,
    counts_from_vllm_metrics,
    parse_prometheus_text,
)
from peagle.evaluate.vllm_job import spec_decode_counts

# Two data-parallel engines and a second served model, as vLLM 0.32 exposes them (with the
# `_created` series prometheus_client adds, a histogram and an unrelated counter mixed in).
EXPOSITION = r'''
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 50.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 7.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7959583000366256e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 400.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="tiny"} 200.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="other"} 28.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 180.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="tiny"} 75.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="other"} 3.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 55.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="3"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="3"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="1"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="2"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="other",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="other",position="1"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="other",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="other",position="3"} 0.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 4.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 9.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 12.5
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 999.0
'''


def test_prometheus_text_sums_engines_and_selects_a_model():
    tiny = counts_from_prometheus_text(EXPOSITION, model_name="tiny")
    assert tiny == SpecDecodeCounts(150, 600, 255, [115, 80, 40, 20])
    assert sum(tiny.accepted_per_pos) == tiny.accepted_tokens and tiny.problems() == []
    assert tiny.acceptance_length == pytest.approx(1 + 255 / 150)
    assert tiny.per_position_acceptance == pytest.approx([115 / 150, 80 / 150, 40 / 150, 20 / 150])
    assert tiny.conditional_acceptance == pytest.approx([115 / 150, 80 / 115, 40 / 80, 20 / 40])
    assert tiny.draft_acceptance_rate == pytest.approx(255 / 600)
    everything = counts_from_prometheus_text(EXPOSITION)  # no selection: all models summed
    assert everything == SpecDecodeCounts(157, 628, 258, [118, 80, 40, 20])


def test_parser_strips_total_skips_created_and_histograms_and_unescapes_labels():
    text = ('a_total{x="q\\"uo\\\\te\\n",y="b,c} d"} 3 1700000000000\n'
            'b{} 2.5e+01\n'
            'c 1\n'
            'a_created{x="1"} 17\n'
            'h_bucket{le="+Inf"} 3\n# EOF\n')
    samples = parse_prometheus_text(text)
    assert [(s.name, s.value) for s in samples] == [("a", 3.0), ("b", 25.0), ("c", 1.0)]
    assert samples[0].labels == {"x": 'q"uo\\te\n', "y": "b,c} d"}
    with pytest.raises(CounterError, match="line 1"):
        parse_prometheus_text('broken{x="1" 3\n')
    with pytest.raises(CounterError, match="position"):
        counts_from_prometheus_text("vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\"} 3\n")


def test_differences_of_snapshots():
    before = counts_from_prometheus_text(EXPOSITION, "tiny")
    after_text = (EXPOSITION.replace('engine="0",model_name="tiny"} 100.0', 'engine="0",model_name="tiny"} 130.0')
                  .replace('draft_tokens_total{engine="0",model_name="tiny"} 400.0',
                           'draft_tokens_total{engine="0",model_name="tiny"} 520.0')
                  .replace('accepted_tokens_total{engine="0",model_name="tiny"} 180.0',
                           'accepted_tokens_total{engine="0",model_name="tiny"} 230.0')
                  .replace('model_name="tiny",position="0"} 80.0', 'model_name="tiny",position="0"} 105.0')
                  .replace('model_name="tiny",position="1"} 55.0', 'model_name="tiny",position="1"} 70.0')
                  .replace('model_name="tiny",position="2"} 30.0', 'model_name="tiny",position="2"} 38.0')
                  .replace('model_name="tiny",position="3"} 15.0', 'model_name="tiny",position="3"} 17.0'))
    delta = counts_from_prometheus_text(after_text, "tiny").minus(before)
    assert delta == SpecDecodeCounts(30, 120, 50, [25, 15, 8, 2])
    assert sum(delta.accepted_per_pos) == delta.accepted_tokens
    assert delta.acceptance_length == pytest.approx(1 + 50 / 30)
    # A fresh server (nothing counted yet, no per-position series) is a valid "before".
    assert delta.minus(SpecDecodeCounts()) == delta
    with pytest.raises(CounterError, match="backwards"):
        before.minus(counts_from_prometheus_text(after_text, "tiny"))
    with pytest.raises(CounterError, match="different K"):
        SpecDecodeCounts(10, 30, 5, [3, 1, 1]).minus(SpecDecodeCounts(5, 20, 2, [1, 1, 0, 0]))
    assert SpecDecodeCounts(2, 8, 9, [1, 3, 5]).problems()  # inconsistent counts are flagged
    assert SpecDecodeCounts().acceptance_length is None and SpecDecodeCounts().per_position_acceptance == []


@dataclass
class _Counter:  # the shape of vllm.v1.metrics.reader.Counter
    name: str
    labels: dict
    value: int


@dataclass
class _Vector:  # the shape of vllm.v1.metrics.reader.Vector
    name: str
    labels: dict
    values: list


@dataclass
class _Gauge:
    name: str
    labels: dict
    value: float


def test_get_metrics_objects_and_prometheus_text_normalise_alike():
    metrics = [
        _Counter("vllm:spec_decode_num_drafts", {"engine": "0", "model_name": "tiny"}, 100),
        _Counter("vllm:spec_decode_num_drafts", {"engine": "1", "model_name": "tiny"}, 50),
        _Counter("vllm:spec_decode_num_draft_tokens", {"engine": "0", "model_name": "tiny"}, 400),
        _Counter("vllm:spec_decode_num_draft_tokens", {"engine": "1", "model_name": "tiny"}, 200),
        _Counter("vllm:spec_decode_num_accepted_tokens", {"engine": "0", "model_name": "tiny"}, 180),
        _Counter("vllm:spec_decode_num_accepted_tokens", {"engine": "1", "model_name": "tiny"}, 75),
        _Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "0", "model_name": "tiny"}, [80, 55, 30, 15]),
        _Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "1", "model_name": "tiny"}, [35, 25, 10, 5]),
        _Gauge("vllm:num_requests_running", {"engine": "0", "model_name": "tiny"}, 3.0),
    ]
    offline = counts_from_vllm_metrics(metrics)
    assert offline == counts_from_prometheus_text(EXPOSITION, "tiny")
    # the legacy dict API of peagle.evaluate.vllm_job is the same normaliser
    assert spec_decode_counts(metrics) == {"drafts": 150, "draft_tokens": 600, "accepted_tokens": 255,
                                           "accepted_per_pos": [115, 80, 40, 20]}
    assert spec_decode_counts([]) == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}


def test_vllm_reader_and_exposition_of_the_same_registry_agree():
    """vLLM's own reader (what LLM.get_metrics() returns) and the text a server would expose,
    produced from one prometheus registry holding the counters vLLM defines."""
    pytest.importorskip("vllm")
    prometheus_client = pytest.importorskip("prometheus_client")
    from vllm.v1.metrics.reader import get_metrics_snapshot

    registry = prometheus_client.REGISTRY  # get_metrics_snapshot reads the global registry
    labels = ["model_name", "engine"]
    made = [prometheus_client.Counter(name, "test", labels, registry=registry) for name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")]
    per_pos = prometheus_client.Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "test", labels + ["position"],
                                        registry=registry)
    try:
        for engine, (d, acc) in enumerate([((40, 160, 70), [30, 20, 15, 5]), ((10, 40, 12), [8, 3, 1, 0])]):
            for counter, value in zip(made, d):
                counter.labels("tiny", str(engine)).inc(value)
            for pos, value in enumerate(acc):
                per_pos.labels("tiny", str(engine), str(pos)).inc(value)
        from_reader = counts_from_vllm_metrics(get_metrics_snapshot())
        from_text = counts_from_prometheus_text(prometheus_client.generate_latest(registry).decode())
    finally:
        for c in (*made, per_pos):
            registry.unregister(c)
    assert from_reader == from_text == SpecDecodeCounts(50, 200, 82, [38, 23, 16, 5])
