"""The draft vocabulary: the selection rule, and ``--token-freq`` files (draft init) -- a bad one exits 2
naming the file and the key, a good one selects the draft's token ids."""
from __future__ import annotations

import json

import pytest
import torch

from peagle.cli import main
from peagle.model.vocab import build_vocab_maps, select_draft_tokens


def test_vocab_selection_rule():
    counts = {5: 10, 3: 10, 9: 4, 1: 7}
    # (-count, id) ranking: 3, 5, 1, 9 -> top-3 = {3, 5, 1}, sorted ascending
    assert select_draft_tokens(counts, 16, 3).tolist() == [1, 3, 5]
    # fewer counted ids than requested: pad with the smallest unused ids
    assert select_draft_tokens(counts, 16, 6).tolist() == [0, 1, 2, 3, 5, 9]
    d2t, t2d = build_vocab_maps(counts, 16, 3)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 2, 3]  # offsets: target = i + d2t[i]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        select_draft_tokens({99: 1}, 16, 3)


@pytest.mark.parametrize("content, msg", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    (b"\xff\xfe{", "not valid JSON"),
    ("[1, 2, 3]", "JSON object"),
    ('{"abc": 3}', "key 'abc'"),
    ('{"1.5": 3}', "key '1.5'"),
    ('{"7": 2.5}', "token 7"),
    ('{"7": "3"}', "token 7"),
    ('{"7": true}', "token 7"),
    ('{"7": -3}', "token 7"),
    ('{"7": 1, "07": 2}', "token 7"),
    ('{"5": 1, "100000": 4}', "token id 100000"),
    ('{"-1": 4}', "token id -1"),
    ('{"' + "9" * 5000 + '": 4}', "key '999"),
    ('{"3": ' + "9" * 5000 + "}", "not valid JSON"),
])
def test_bad_token_freq_file_exits_2_naming_file_and_key(qwen3_target, tmp_path, capsys, content, msg):
    f = tmp_path / "freq.json"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    out = tmp_path / "draft"
    assert main(["draft", "init", "--target", str(qwen3_target), "--out", str(out), "--token-freq", str(f),
                 "--draft-vocab-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and str(f) in err and msg in err, err
    assert len(err) < 400  # long keys and values are clipped
    assert not out.exists()


def test_good_token_freq_file_selects_the_draft_vocabulary(qwen3_target, tmp_path, capsys):
    from peagle.model import read_spec
    from peagle.model.adapter import load_draft

    f = tmp_path / "freq.json"
    f.write_text(json.dumps({"9": 50, "3": 40, "200": 30, "0": 0}))
    out = tmp_path / "draft"
    assert main(["draft", "init", "--target", str(qwen3_target), "--out", str(out), "--token-freq", str(f),
                 "--draft-vocab-size", "4"]) == 0, capsys.readouterr().err
    assert read_spec(out).draft_vocab_size == 4
    model = load_draft(out)
    assert (model.t2d.nonzero().flatten().tolist()) == [0, 3, 9, 200]
