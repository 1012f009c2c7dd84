"""llama-server's HTTP endpoints: where they are, and what their answers mean. Pure.

    /health   connection refused while starting, 503 while loading, 200 {"status":"ok"} serving
    /props    default_generation_settings.n_ctx (per slot), total_slots
    /slots    per slot is_processing (501 with --no-slots)
    /metrics  Prometheus text, series named llamacpp:... (needs --metrics)

A status of 0 below means nothing answered (refused, timed out, not HTTP).
"""

from __future__ import annotations

from typing import Literal

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

HEALTH, PROPS, SLOTS, METRICS = "/health", "/props", "/slots", "/metrics"
# Binds that listen on every interface: a client connects to the loopback address instead.
WILDCARD_BINDS = ("0.0.0.0", "::", "")
LLAMA_PREFIX = "llamacpp:"
EXPORT_PREFIX = "lanes_llama_"

Readiness = Literal["loading", "healthy", "mismatch"]


def connect_host(bind: str) -> str:
    """The address a local client connects to for a server bound to `bind`."""
    return "127.0.0.1" if bind in WILDCARD_BINDS else bind


def url(bind: str, port: int, path: str) -> str:
    host = connect_host(bind)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


def answered(path: str, status: int) -> str:
    return f"{path} answered {status or 'nothing'}"


def is_healthy(status: int) -> bool:
    """/health: 200 once the model is loaded and the server takes requests."""
    return status == 200


def props_readiness(status: int, props: object, *, ctx_per_slot: int, parallel: int) -> tuple[Readiness, str]:
    """/props of a lane whose /health said ok: does it serve the planned shape?"""
    if status != 200 or not isinstance(props, dict):
        return "loading", answered(PROPS, status)
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    slots = props.get("total_slots")
    if n_ctx != ctx_per_slot or slots != parallel:
        return "mismatch", (
            f"llama-server serves {n_ctx} per slot x {slots} slots; planned {ctx_per_slot} x {parallel}"
        )
    return "healthy", ""


def busy_slots(status: int, slots: object) -> int | None:
    """Slots processing a request; None when nothing answers (so nothing serves)."""
    if status == 0:
        return None
    if status != 200 or not isinstance(slots, list):
        return 1  # it answers but cannot say: count it busy, so only the drain timeout ends the wait
    return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))


# Each busy slot's (task id, tokens in the slot, prompt tokens processed, tokens decoded): llama-server
# moves them once per batch of the prompt and once per token (bench/RESULTS.md, "A busy loop").
LoopWork = tuple[tuple[int, int, int, int], ...]
_PROGRESS_FIELDS = ("id_task", "n_prompt_tokens", "n_prompt_tokens_processed")


def loop_work(status: int, slots: object) -> LoopWork | None:
    """What /slots says the inference loop is doing; None when it did not answer.

    The binary answers /slots within milliseconds even while its loop is deep in a long
    prefill (measured), so a loop that works moves these counters between two reads at
    most one batch apart, and one that is stuck leaves them as they were. A build that
    cannot say (--no-slots, an error status) gives () like an idle one: no stall is read from it.
    """
    if status == 0:
        return None
    if status != 200 or not isinstance(slots, list):
        return ()
    work = []
    for slot in slots:
        if not isinstance(slot, dict) or not slot.get("is_processing"):
            continue
        nexts = slot.get("next_token")
        first = nexts[0] if isinstance(nexts, list) and nexts and isinstance(nexts[0], dict) else {}
        values = [slot.get(f) for f in _PROGRESS_FIELDS] + [first.get("n_decoded")]
        work.append(tuple(v if isinstance(v, int) else -1 for v in values))
    return tuple(sorted(work))


# One /slots read: ("busy", busy slots, their counters); ("timeout", 0, ()): no answer in time;
# ("unknown", 0, ()): it answered but cannot say (--no-slots, an error status).
SlotsRead = tuple[Literal["busy", "timeout", "unknown"], int, LoopWork]


def slots_read(status: int, slots: object) -> SlotsRead:
    """What one /slots answer (status 0: none) says of the lane's load and loop."""
    if status == 0:
        return ("timeout", 0, ())
    if status != 200 or not isinstance(slots, list):
        return ("unknown", 0, ())
    return ("busy", busy_slots(200, slots) or 0, loop_work(200, slots) or ())


def rename_llama_series(text: str, labels: dict[str, str]) -> list[Metric]:
    """/metrics text as `lanes_llama_*` families with our labels added.

    Colons in names are for recording rules, so llama-server's series are re-exported
    under lanes' own prefix. Raises ValueError on text that is not exposition format.
    """
    out = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(LLAMA_PREFIX):
            continue
        name = EXPORT_PREFIX + family.name[len(LLAMA_PREFIX) :]
        metric = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            sample_name = EXPORT_PREFIX + sample.name[len(LLAMA_PREFIX) :]
            metric.add_sample(sample_name, {**sample.labels, **labels}, sample.value)
        out.append(metric)
    return out


def slot_action(slot: int, action: Literal["save", "restore", "erase"]) -> str:
    """POST path of a slot file action (needs --slot-save-path; body {"filename": name})."""
    return f"{SLOTS}/{slot}?action={action}"


def slot_contents(status: int, slots: object) -> tuple[tuple[int, int, int, bool], ...] | None:
    """Each slot's (id, tokens it holds, its last task id, busy) from /slots; None: no answer
    that says. A slot that never ran a task since start shows no tokens (0 here)."""
    if status != 200 or not isinstance(slots, list):
        return None
    out = []
    for slot in slots:
        if not isinstance(slot, dict) or not isinstance(slot.get("id"), int):
            continue
        tokens, task = slot.get("n_prompt_tokens"), slot.get("id_task")
        out.append((slot["id"], tokens if isinstance(tokens, int) else 0, task if isinstance(task, int) else -1,
                    bool(slot.get("is_processing"))))  # fmt: skip
    return tuple(out)
