"""The gate's neighbouring set (peagle.gate.neighbour, issue #40): prompts of the traffic's domain from another
source, chosen per domain (``gate.neighbour``), defaulting to the project's and MT-Bench's slice for the domain
the held-out traffic reads as, and a loss there beyond ``gate.neighbour_tolerance`` rejects the candidate."""
from __future__ import annotations

import pytest

from peagle.evaluate.prompts import Prompt, PromptSet, load_prompt_sets
from peagle.gate.neighbour import NEIGHBOUR, detect_domain, neighbour_prompt_set
from peagle.gate.run import gate_checks, paired_comparison
from peagle.gate.settings import GateSettings


def prompts_of(name: str) -> PromptSet:
    return PromptSet("traffic", name, "", [p for ps in load_prompt_sets([name]).values() for p in ps.prompts])


def test_code_traffic_gets_the_code_slice_of_the_projects_sets_and_mtbench():
    traffic = prompts_of("humaneval")
    assert detect_domain(traffic.prompts) == ("code", 1.0)
    ps, note = neighbour_prompt_set("auto", traffic)
    assert ps is not None and ps.category == NEIGHBOUR and ps.source == "code+mtbench:coding"
    assert len(ps.prompts) == 20 and {p.id.split("-")[0] for p in ps.prompts} == {"code", "mtbench"}
    assert "100% of the held-out traffic reads as code" in note and "MT-Bench" in ps.attribution
    math, _ = neighbour_prompt_set("auto", prompts_of("mtbench:math"))
    assert math is not None and math.source == "math+mtbench:math"


@pytest.mark.parametrize("name", ["sharegpt-heldout@64", "mtbench", "writing"])
def test_traffic_of_no_known_domain_gets_none_and_says_why(name):
    ps, note = neighbour_prompt_set("auto", prompts_of(name))
    assert ps is None and "no known domain" in note and "50% needed" in note


def test_the_user_chooses_the_set_or_none_and_a_traffic_prompt_is_never_its_own_neighbour():
    traffic = prompts_of("code@3")
    ps, note = neighbour_prompt_set("code+mtbench:coding@4", traffic)
    assert ps is not None and ps.source == "code+mtbench:coding@4" and "(gate.neighbour)" in note
    # the three traffic prompts are left out of the code set; MT-Bench's first four stay
    assert len(ps.prompts) == 10 - 3 + 4
    assert not {p.messages[0]["content"] for p in ps.prompts} & {p.messages[0]["content"] for p in traffic.prompts}
    assert neighbour_prompt_set("", traffic) == (None, "no neighbouring set (gate.neighbour is empty)")
    one = PromptSet("traffic", "x", "", [Prompt("t1", ({"role": "user", "content": "Write a poem about rain."},))])
    assert detect_domain(one.prompts) == (None, 0.0) and detect_domain([]) == (None, 0.0)


def _comparison(gain: float, n: int = 48):
    serving = [[6 + i % 3, 4 + i % 2] for i in range(n)]  # K=1 histograms, varied per prompt
    moved = [[h[0] - round(gain * sum(h)), h[1] + round(gain * sum(h))] for h in serving]
    return paired_comparison(serving, moved, resamples=200)


def test_a_loss_next_door_beyond_the_tolerance_rejects_the_candidate():
    settings = GateSettings(margin=0.02, tolerance=0.05, neighbour_tolerance=0.05)
    sets = {"traffic": _comparison(0.1), "general": _comparison(0.0)}
    lossless = {"dtype": "float32", "num_speculative_tokens": 1, "compared": 2, "identical": 2,
                "differing_prompts": [], "accepted_tokens": 1, "generated_tokens": 8}

    def checks(neighbour_gain: float | None, asked: bool = True):
        s = dict(sets) if neighbour_gain is None else {**sets, NEIGHBOUR: _comparison(neighbour_gain)}
        return {c.name: c for c in gate_checks(traffic_prompts=48, sets=s, lossless_float32=lossless,
                                               loads=(True, "ok"), settings=settings, neighbour=asked)}

    within = checks(-0.0)["neighbour_loss"]
    assert within.passed and within.threshold == -0.05 and "neighbouring prompts" in within.detail
    lost = checks(-0.2)["neighbour_loss"]
    assert not lost.passed and lost.value == pytest.approx(-0.2, abs=0.02)
    assert all(c.passed for name, c in checks(-0.2).items() if name != "neighbour_loss")  # only next door lost
    assert not checks(None)["neighbour_loss"].passed  # asked for, not measured: not a pass
    assert "neighbour_loss" not in checks(None, asked=False)  # no neighbouring set: no check
