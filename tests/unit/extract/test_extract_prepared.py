"""``extract_prepared`` (issue 38): the one way ``peagle extract``, the pipeline's extract step and the refresh's
extract step run the extraction over a published prepared dataset, split by split."""
from __future__ import annotations

import pytest

from peagle.data import PrepareError
from peagle.extract import ExtractSettings, open_hidden_states
from peagle.extract.hidden_states import HiddenStates
from peagle.extract.run import extract_prepared
from peagle.storage import open_store
from support.extract_shards import HF
from support.prepared_data import random_rows, write_prepared


def test_each_split_is_extracted_and_an_empty_one_is_skipped(qwen3_target, tmp_path, monkeypatch):
    rows = random_rows(5, 6, seed=1, supervised_from=2)
    write_prepared(tmp_path / "data", rows)
    monkeypatch.chdir(tmp_path)  # a relative --data: the plan records the absolute path a trainer can open
    parts = list(extract_prepared("data", qwen3_target, lambda split: str(tmp_path / "hs" / split),
                                  ExtractSettings(**HF)))
    assert [(p.split, p.data.name) for p in parts] == [("train", "data"), ("validation", "data")]
    train, validation = parts[0].result, parts[1].result
    assert validation is None and not (tmp_path / "hs" / "validation").exists()
    assert train.num_samples == 5 and train.manifest is not None
    plan = HiddenStates(open_store(str(tmp_path / "hs" / "train"))).plan()
    assert (plan.prepared, plan.split) == (str((tmp_path / "data").resolve()), "train")
    dataset = open_hidden_states(tmp_path / "hs" / "train")
    ids = [sid for shard in dataset.iter_shards() for sid in shard.sample_ids]
    assert sorted(ids) == sorted(r["sample_id"] for r in rows)


def test_what_is_not_prepared_data_is_refused_naming_it(qwen3_target, tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(PrepareError, match="data"):
        next(extract_prepared(tmp_path / "data", qwen3_target, lambda split: str(tmp_path / split)))
