"""Did a span lane really run across its hosts? llama-server's printed buffers against the plan.

A llama-server whose --rpc target it could not use, or one built without RPC, may still
serve the whole model locally; nothing else would notice. After start the serving agent
checks that every worker's RPC device printed its buffers, with the planned sizes (model,
KV and output to the printed two decimals; compute no more than planned, within
printed.COMPUTE_TOLERANCE: a compute buffer smaller than reserved is safe), and fails the lane
with the reason otherwise. Pure: lines in, a reason or None out.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.llama.logs import parse_buffers
from shared.llama.printed import Check, compare
from shared.messages.plans import LaneSpec

# Feedback whose detail starts so: the planner gives that serving host no span for the model
# until the feedback expires (planner_svc.spans.span_blocked).
SPAN_FAILED = "span check failed"


def span_problem(spec: LaneSpec, lines: Iterable[str]) -> str | None:
    if not spec.workers:
        return None
    printed = parse_buffers(list(lines))
    checks = compare(spec.memory.devices, printed)
    for w in spec.workers:
        name = f"GPU{w.index}"
        if printed.get(name, "model") <= 0:
            return (f"{SPAN_FAILED}: worker {w.host_id} ({w.endpoint}) is missing from llama-server's buffer lines"
                    " (the lane did not run across hosts)")  # fmt: skip
        bad = [c for c in checks if c.device == name and not _holds_plan(c)]
        if bad:
            c = bad[0]
            return (f"{SPAN_FAILED}: worker {w.host_id} ({w.endpoint}) printed {c.kind} {c.printed_mib:.2f} MiB,"
                    f" planned {c.predicted_mib:.2f} MiB")  # fmt: skip
    return None


def _holds_plan(check: Check) -> bool:
    if check.kind == "compute":
        return check.ok or check.printed_mib < check.predicted_mib
    return check.ok
