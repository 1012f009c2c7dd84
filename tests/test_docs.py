"""The docs site builds with every link and anchor resolved, and its reference pages are what
the code generates (scripts/gen_reference.py), so neither can drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_reference_pages_are_generated_from_the_code():
    done = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_mkdocs_build_strict(tmp_path):
    """Links to missing pages or anchors, and pages left out of the nav, fail the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_readme_is_short_and_links_resolve():
    """A newcomer's README: about 200 lines, and every relative link names a file that exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 210
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target
