"""The operator's files under deploy/: the Prometheus alert rules pass their promtool unit tests
(each alert fires on its series and stays quiet otherwise), and a rule that changes meaning fails
them. (The Grafana board's and the rules' metric names are checked against the real services in
tests/test_metrics.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("no promtool: install Debian's prometheus package (scripts/test does)")
    return found


def test_alert_rules_are_valid_and_their_unit_tests_pass():
    for args in (["check", "rules", "lanes-rules.yml"], ["test", "rules", "lanes-rules.test.yml"]):
        done = subprocess.run([_promtool(), *args], cwd=RULES, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_unit_tests_catch_a_rule_that_changed(tmp_path):
    """A lane-down rule that waits 10 minutes instead of 2 no longer fires when its test says."""
    rules = (RULES / "lanes-rules.yml").read_text()
    assert rules.count("        for: 2m\n") == 1
    (tmp_path / "lanes-rules.yml").write_text(rules.replace("        for: 2m\n", "        for: 10m\n"))
    shutil.copy(RULES / "lanes-rules.test.yml", tmp_path)
    done = subprocess.run([_promtool(), "test", "rules", "lanes-rules.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "LanesLaneDown" in done.stdout + done.stderr
