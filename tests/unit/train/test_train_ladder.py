"""The session's artefact ladder (tests/support/ladder.py) holds what its fixtures promise."""
from __future__ import annotations

import hashlib

from peagle.data import PreparedData
from peagle.model import load_draft
from peagle.model.adapter import Draft, read_spec
from peagle.train.data import open_dataset
from support.ladder import LADDER_CONVERSATIONS, LADDER_DRAFT


def test_the_ladder_builds_each_artefact_from_the_one_before(qwen3_target, ladder_prepared, ladder_hidden_states,
                                                           ladder_drafts):
    assert PreparedData.open(ladder_prepared).table("train").num_rows == LADDER_CONVERSATIONS
    ds = open_dataset(str(ladder_hidden_states))
    assert len(ds) == LADDER_CONVERSATIONS
    init, trained = ladder_drafts
    for d in (init, trained):
        spec = read_spec(d)
        assert spec.num_depths == LADDER_DRAFT["num_depths"] and load_draft(d) is not None
    digests = {hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (init, trained)}
    assert len(digests) == 2 and Draft.open(str(init)).fingerprint != Draft.open(str(trained)).fingerprint
