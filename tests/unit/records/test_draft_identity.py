"""One draft identity (issue #38): one digest of the weights and the config, one fingerprint of it, read the same
from a directory and from a publication, and carried the same by a record from every serving path."""
from __future__ import annotations

import argparse
import shutil

import pytest

from peagle.cli import main as peagle_main
from peagle.deploy.cli import build_parser as deploy_parser
from peagle.deploy.cli import served_draft_fingerprint, values_from_args
from peagle.model.adapter import Draft
from peagle.pipeline.deployment import draft_fingerprint as pipeline_draft_fingerprint
from peagle.pipeline.layout import RunLayout
from peagle.records.identity import (FINGERPRINT_DIGITS, DraftIdentity, DraftIdentityError, fingerprint_of,
                                     identify_draft)
from peagle.rollout.assemble import cluster_rollout
from peagle.rollout.local import candidate_of
from peagle.storage import LocalStore, publish_dir
from peagle.traffic.log import TrafficLog
from peagle.commands.serve import ServeConfig
from peagle.traffic.serve import server_command
from peagle.traffic.settings import CaptureSettings
from support.traffic_records import traffic_record, write_records


def test_digest_is_of_the_weights_and_config_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"weights")
        (d / "config.json").write_text("{}")
    (b / "notes.txt").write_text("anything else")  # not part of what the draft is
    first = identify_draft(a)
    assert identify_draft(b) == first and len(first.digest) == 64
    assert first.fingerprint == first.digest[:FINGERPRINT_DIGITS] and len(first.fingerprint) == 12
    (b / "config.json").write_text('{"a": 1}')
    assert identify_draft(b) != first


def test_a_publication_is_named_from_its_manifest_as_its_files_are(tmp_path, ladder_init_draft):
    # the same files published twice (other metadata, another time): one identity, the directory's
    again = tmp_path / "again"
    publish_dir(LocalStore(again), "", ladder_init_draft, {"kind": "peagle-draft", "note": "republished"})
    assert identify_draft(again) == identify_draft(ladder_init_draft) == Draft.open(str(again)).identity
    assert Draft.open(str(ladder_init_draft)).fingerprint == identify_draft(ladder_init_draft).digest


def test_spellings_and_errors(tmp_path):
    digest = "ab" * 32
    assert fingerprint_of(digest) == "ab" * 6 and fingerprint_of("0123456789ab") == "0123456789ab"
    assert fingerprint_of("") is None and fingerprint_of(None) is None
    assert DraftIdentity(digest=digest).names(digest) and DraftIdentity(digest=digest).names("ab" * 6)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        DraftIdentity(digest="ABC")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DraftIdentityError, match="neither a directory with model.safetensors and config.json"):
        identify_draft(tmp_path)


def test_peagle_draft_fingerprint_prints_it(ladder_init_draft, capsys):
    assert peagle_main(["draft", "fingerprint", str(ladder_init_draft)]) == 0
    assert capsys.readouterr().out.strip() == identify_draft(ladder_init_draft).fingerprint
    assert peagle_main(["draft", "fingerprint", "--digest", str(ladder_init_draft)]) == 0
    assert capsys.readouterr().out.strip() == identify_draft(ladder_init_draft).digest


def _record_served(draft, capture: CaptureSettings, log) -> str | None:
    """The draft fingerprint of a record the capture writes for a server with these settings."""
    assert capture.draft_dir == str(draft)
    write_records(LocalStore(log), [traffic_record("hi", model="m")], draft_dir=capture.draft_dir,
                  draft_fingerprint=capture.draft_fingerprint)
    (record,) = TrafficLog(str(log)).records()
    return record.draft_fingerprint


def test_every_serving_path_names_the_same_draft_the_same_way(tmp_path, qwen3_target, ladder_init_draft, capsys):
    want = identify_draft(ladder_init_draft).fingerprint

    # peagle serve --capture: the middleware's settings come from the server's environment
    _, env = server_command(str(qwen3_target), str(ladder_init_draft), k=2,
                            capture=ServeConfig(capture=CaptureSettings(enabled=True, uri=str(tmp_path / "log"))).capture)
    served = CaptureSettings.from_env(env)
    assert served.draft_fingerprint == "" and _record_served(ladder_init_draft, served, tmp_path / "serve") == want

    # peagle deploy --draft-uri: the pods' label and served model name; the pods' records are the middleware's,
    # computed from the files the pod serves (tests/integration/helm/test_traffic_chart.py renders that)
    ns = deploy_parser().parse_args(["--name", "qwen3", "--draft-uri", str(ladder_init_draft),
                                     "--target-uri", str(qwen3_target)])
    assert values_from_args(ns)["speculative"]["draftFingerprint"] == want
    assert served_draft_fingerprint(argparse.Namespace(draft_fingerprint="given", draft_uri=None,
                                                       storage_uri=None)) == "given"

    # the pipeline's deploy step: the run's published models/draft
    run = tmp_path / "run"
    shutil.copytree(ladder_init_draft, RunLayout(str(run)).draft)
    assert pipeline_draft_fingerprint(RunLayout(str(run))) == want

    # peagle rollout (cluster) and peagle rollout local: the candidate's label, the records its server writes
    rollout = cluster_rollout(name="qwen3", namespace="ns", routing="route", mode="deployment", stable_values={},
                              candidate_draft=str(ladder_init_draft), candidate_values={})
    assert rollout.candidate.fingerprint == want
    local = candidate_of(str(ladder_init_draft))
    local_capture = CaptureSettings(enabled=True, uri="x", draft_dir=str(ladder_init_draft),
                                    draft_fingerprint=local.fingerprint)  # as LocalBackend serves it
    assert _record_served(ladder_init_draft, local_capture, tmp_path / "local") == want
