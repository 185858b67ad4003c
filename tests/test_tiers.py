"""The test tiers (tests/conftest.py): every collected test is in exactly one of unit / integration / e2e,
so ``-m unit``, ``-m integration`` and ``-m e2e`` together run the whole suite, each test once."""
import pytest

from conftest import TIERS, TIERS_SEEN, tiers_of


def test_every_collected_test_has_exactly_one_tier(request):
    seen = request.config.stash[TIERS_SEEN]  # all collected tests of this session, -m deselection not applied
    assert request.node.nodeid in seen
    wrong = {nodeid: tiers for nodeid, tiers in seen.items() if len(tiers) != 1 or tiers[0] not in TIERS}
    assert not wrong, f"tests without exactly one tier: {wrong}"


def test_the_selected_tests_carry_their_tier_marker(request):
    # What -m selects on: the marker the hook added (or the explicit one).
    for item in request.session.items:
        assert sorted(t for t in TIERS if item.get_closest_marker(t)) == request.config.stash[TIERS_SEEN][item.nodeid]


@pytest.mark.parametrize("markers, fixtures, tiers", [
    (set(), {"tmp_path"}, ["unit"]),                                   # the default
    ({"vllm"}, set(), ["integration"]),                               # a real vLLM engine
    (set(), {"seaweed_server", "weed_binary", "tmp_path"}, ["integration"]),  # a real S3 server
    ({"integration"}, set(), ["integration"]),                        # explicit (Helm SDK, kfp.local, torchrun)
    ({"e2e", "vllm"}, {"weed_binary"}, ["e2e"]),                   # a pipeline run uses them all
    ({"unit", "vllm"}, set(), ["integration", "unit"]),               # a server in the fast tier: refused
    ({"integration", "e2e"}, set(), ["e2e", "integration"]),          # two explicit tiers: refused
])
def test_tier_rules(markers, fixtures, tiers):
    assert tiers_of(markers, fixtures) == tiers
