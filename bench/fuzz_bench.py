"""Fuzzing at benchmark scale: at least 10,000 examples for each subject and KV key a service
consumes, against a real nats-server, planner and agent (tests/test_fuzz.py's fleet).

Each target runs in its own pytest process with LANES_FUZZ_TARGET and LANES_FUZZ_EXAMPLES;
a run passes when every hostile input was answered or dropped as the test expects, both
services still run (0 crashes), and the one lane is the same process with no other lane
started (0 spawns). Results go to bench/fuzz_results.md.

  .venv/bin/python bench/fuzz_bench.py                 # every target, 10,000 examples each
  .venv/bin/python bench/fuzz_bench.py --examples 500 --targets plans config
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_fuzz import ENDPOINTS, PLANNER_KEYS  # noqa: E402

TESTS = {
    **{e: "test_fuzz_request_endpoints" for e in ENDPOINTS},
    **{k: "test_fuzz_planner_kv_entries" for k in PLANNER_KEYS},
    "plans": "test_fuzz_plans",
    "rejections": "test_fuzz_rejections",
    "demand": "test_fuzz_wakes_and_activity",
}
WHAT = {
    **{e: f"planner/agent endpoint {e} (request/reply)" for e in ENDPOINTS},
    **{k: f"KV key {k} (planner's watch)" for k in PLANNER_KEYS},
    "plans": "KV key plan.host1 (the agent's plan)",
    "rejections": "subject lanes.rejected.host1 (planner)",
    "demand": "subjects lanes.wake.* and lanes.activity.* (planner)",
}
_SENT = re.compile(r"(request fuzz: \d+ requests sent|kv fuzz: .*|plan fuzz: \d+ bad plans sent|rejection fuzz: .*|demand fuzz: .*)")


def run(target: str, examples: int, timeout: float) -> dict:
    env = dict(os.environ, LANES_FUZZ_TARGET=target, LANES_FUZZ_EXAMPLES=str(examples))
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_fuzz.py",
            "-k", f"{TESTS[target]} or test_fleet_answers_after_fuzz"]  # fmt: skip
    began = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), -1
    seconds = time.monotonic() - began
    sent = _SENT.search(out)
    summary = re.search(r"\d+ passed.*|\d+ failed.*", out)
    return {
        "target": target,
        "examples": examples,
        "passed": code == 0,
        "seconds": seconds,
        "sent": sent.group(1)[:160] if sent else "",
        "summary": summary.group(0) if summary else out[-300:],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--targets", nargs="*", default=list(TESTS))
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "fuzz_results.md"))
    args = parser.parse_args()
    rows = []
    for target in args.targets:
        result = run(target, args.examples, args.timeout)
        rows.append(result)
        print(f"{target}: {'ok' if result['passed'] else 'FAILED'} in {result['seconds']:.0f} s; {result['sent']}",
              flush=True)
    lines = [
        "# Fuzzing at benchmark scale",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- Machine: {platform.platform()}, {os.cpu_count()} cores (shared with other work)",
        f"- Command: `.venv/bin/python bench/fuzz_bench.py --examples {args.examples}`",
        "- Each target: a real nats-server, planner and agent (one lane on the fake llama-server);",
        "  hypothesis draws the examples; an example the services must accept is not sent.",
        "- Passed = every hostile input answered (400/404) or dropped with a log line, or its plan",
        "  rejected; 0 crashes (both services still run) and 0 spawns (the lane is the same",
        "  process and no other lane process exists).",
        "",
        "| target | consumed by | examples drawn | sent (from the test's own count) | result | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        result = "passed, 0 crashes, 0 spawns" if r["passed"] else f"FAILED: {r['summary']}"
        lines.append(f"| {r['target']} | {WHAT[r['target']]} | {r['examples']} | {r['sent']} | {result} | "
                     f"{r['seconds']:.0f} |")  # fmt: skip
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
