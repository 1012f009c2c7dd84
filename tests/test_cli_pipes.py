"""`lanes ... | head -1`: a command whose reader goes away ends quietly (no traceback, SIGPIPE's
status), and one whose reader stays gets whole, valid JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from closed_pipe import run_into_closed_pipe

LANES = [sys.executable, "-m", "lanes.cli"]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["models", "{model}"], ["models", "{model}", "--json"],
                                  ["estimate", "{model}", "--ctx", "4096", "--json"],
                                  ["estimate", "{model}", "--ctx", "4096"]])  # fmt: skip
def test_offline_commands_end_quietly_when_the_reader_is_gone(args, tiny_models):
    argv = [*LANES, *(a.format(model=tiny_models["llama8"]) for a in args)]
    done = run_into_closed_pipe(argv)
    assert done.stderr == ""
    # argparse's own --help/--version swallow the broken pipe and exit 0; the commands exit as SIGPIPE does
    assert done.returncode == (0 if args[0].startswith("--") else 141)


def test_json_stays_whole_for_a_reader_that_reads(tiny_models):
    done = subprocess.run([*LANES, "estimate", str(tiny_models["llama8"]), "--ctx", "4096", "--json"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and json.loads(done.stdout)["kv_bytes"] > 0
