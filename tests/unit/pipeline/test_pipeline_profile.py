"""The cluster profile (src/peagle/pipeline/profile.py): what it refuses, naming the field."""
from __future__ import annotations

import pytest
import yaml

HW_NAME = "opendatahub.io/hardware-profile-name"


def test_a_step_cannot_be_left_without_a_deadline(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    p = tmp_path / "p.yaml"
    p.write_text("steps:\n  extract: {timeout_s: null}\n")
    with pytest.raises(ConfigError, match=r"steps\.extract\.timeout_s"):
        load_profile(p)
    p.write_text("trainjob: {timeout_s: 7200}\nsteps:\n  train_launcher: {timeout_s: 3600}\n")
    with pytest.raises(ConfigError, match=r"train_launcher.*trainjob\.timeout_s"):
        load_profile(p)
    p.write_text("trainjob: {timeout_s: 7200}\n")
    assert load_profile(p).step("train_launcher").timeout_s > 7200  # follows the TrainJob's timeout


def test_trainjob_poll_interval_is_bounded(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    prof = tmp_path / "p.yaml"
    prof.write_text("trainjob: {poll_interval_s: 1.0e+18}\n")
    with pytest.raises(ConfigError, match="trainjob.poll_interval_s"):
        load_profile(prof)
    prof.write_text("trainjob: {poll_interval_s: 3600}\n")
    assert load_profile(prof).trainjob.poll_interval_s == 3600


def test_a_hardware_profile_name_kubernetes_refuses_is_a_profile_error(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    prof = tmp_path / "profile.yaml"
    prof.write_text(f"name: q\naccelerator:\n  annotations:\n    {HW_NAME}: H100 GPUs\n")
    with pytest.raises(ConfigError, match=rf"accelerator\.annotations: {HW_NAME}: 'H100 GPUs' is not a DNS-1123 "
                                          "subdomain"):
        load_profile(prof)


def test_profile_rejects_unknown_keys(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    p = tmp_path / "bad.yaml"
    p.write_text("imagez: {}\n")
    with pytest.raises(ConfigError, match="imagez"):
        load_profile(p)


@pytest.mark.parametrize("field, value", [
    ("retry.backoff_duration", "abc"), ("retry.backoff_duration", "-60s"), ("retry.backoff_duration", "1.5h"),
    ("retry.backoff_duration", float("nan")), ("retry.backoff_duration", float("inf")),
    ("retry.backoff_duration", -1), ("retry.backoff_duration", 1e300), ("retry.backoff_duration", True),
    ("retry.backoff_duration", "99999999999999999999s"), ("retry.backoff_max_duration", "400d"),
    ("retry.backoff_max_duration", "1 fortnight"), ("retry.backoff_max_duration", [60]),
    ("retry.backoff_factor", float("nan")), ("retry.backoff_factor", float("inf")), ("retry.backoff_factor", -2),
    ("steps.train.timeout_s", 10**20), ("steps.train.timeout_s", float("inf")), ("steps.train.timeout_s", "1h"),
    ("steps.train.timeout_s", 0), ("trainjob.timeout_s", float("nan")), ("trainjob.timeout_s", float("inf")),
    ("trainjob.timeout_s", -1), ("trainjob.timeout_s", 1e300), ("trainjob.timeout_s", "abc"),
    ("trainjob.startup_grace_s", float("inf")), ("trainjob.poll_interval_s", 1e12),
    ("serving.timeout_s", float("inf")), ("serving.timeout_s", 10**30),
    ("accelerator.tolerations.0.toleration_seconds", 10**20),
    ("accelerator.tolerations.0.toleration_seconds", -5),
])
def test_bad_profile_duration_names_the_field(tmp_path, field, value):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    data: dict = {}
    cur = data
    parts = field.split(".")
    for i, p in enumerate(parts[:-1]):
        if parts[i + 1].isdigit():
            cur[p] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
            cur = cur[p][0]
            continue
        if p.isdigit():
            continue
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"cluster profile {f}: {field}: ") as e:
        load_profile(f)
    assert len(str(e.value)) < 400
