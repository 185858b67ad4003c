"""``peagle deploy`` on the command line (renders with the Helm SDK: tests/integration/helm/test_deploy.py)."""
from __future__ import annotations


def test_deploy_render_only_over_a_file_is_exit_2(tmp_path, capsys):
    from peagle.deploy.cli import main as deploy_main

    f = tmp_path / "manifests"
    f.write_text("not a directory")
    assert deploy_main(["--name", "qwen3-peagle", "-n", "ml", "--data-connection", "aws-connection-models",
                        "--path", "runs/1/", "--render-only", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and len(err.strip().splitlines()) == 1, err
    assert str(f) in err and "is a file" in err
    assert f.read_text() == "not a directory"


# ---- values.check never quotes a long value in full (folded from test_issue25_followups by h3) ----------

import pytest  # noqa: E402


@pytest.mark.parametrize("rule, value", [("dnsLabel", "x" * 5000), ("dnsLabel", "a b" * 2000),
                                         ("text", "z" * 1000 + "\n"), ("dnsLabel", ["label"] * 5000),
                                         ("image", "Q" * 1000 + ":1"), ("image", "q" * 1000 + " :1")])
def test_value_errors_shorten_the_value(rule, value):
    from peagle.deploy import values as rules

    with pytest.raises(rules.InvalidValue) as err:
        rules.parse_image(value) if rule == "image" else rules.check(rule, value)
    assert len(str(err.value)) < 400 and str(value)[:200] not in str(err.value)
