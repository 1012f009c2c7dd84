"""Speculative decoding for a lane: which speculator, which draft model, and why. Pure.

A persona's `speculative` (or the fleet's): `off`, a --spec-type, or `auto`, which turns on the
speculator bench/spec_bench.py measured fastest for that kind of lane, and only where it gained on
copy-heavy work without losing on free generation (MEASURED holds its figures), with one slot busy
and with as many busy as the lane has (MEASURED_BY_SLOTS: a busy batch leaves drafts less idle
compute to fill, so a gain with one stream can be a loss with eight). A draft model is
the persona's `draft`, or a smaller model on the host with the target's vocabulary (same tokenizer
and n_vocab); a draft whose vocabulary differs is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.memory.speculative import DRAFT_KINDS
from shared.messages.config import FleetConfig, Persona
from shared.messages.hosts import ModelFacts, ServerCaps

# bench/spec_bench.py (bench/spec_results.json, bench/RESULTS.md): decode tokens/s with the speculator
# over without, (copy-heavy: geometric mean of the text and code tasks, free generation), medians of
# 3, per kind of lane (its device, the speculator). CPU lanes: Gemma 3 270M, one slot, one thread;
# draft-simple: a generated target/draft pair, free generation only (its draft never agreed).
# No GPU figures yet: auto stays off on GPU lanes.
MEASURED: dict[tuple[str, str], tuple[float, float]] = {
    ("cpu", "ngram-simple"): (2.61, 1.51),
    ("cpu", "ngram-map-k"): (1.11, 0.53),
    ("cpu", "ngram-mod"): (1.53, 2.42),
    ("cpu", "ngram-cache"): (1.72, 0.95),
    ("cpu", "draft-simple"): (0.30, 0.30),
}
# bench/spec_bench.py --slots 1,2,4,8 (bench/spec_slots.json, 2026-12-06, a quiet machine): the same
# gains with that many slots busy at once (a server of that many slots and 2 threads, each slot
# running one request of the task; total tokens per second over the wall time, prefill included,
# against no speculator at the same count). Where a kind has these, its count-1 figure stands for
# one slot too (one method at every count); MEASURED then only serves the kinds without.
MEASURED_BY_SLOTS: dict[tuple[str, str], dict[int, tuple[float, float]]] = {
    ("cpu", "ngram-simple"): {1: (1.52, 1.30), 2: (1.30, 1.11), 4: (1.15, 1.10), 8: (0.98, 0.96)},
    ("cpu", "ngram-map-k"): {1: (1.23, 1.13), 2: (1.09, 1.16), 4: (1.13, 1.17), 8: (1.21, 1.24)},
    ("cpu", "ngram-mod"): {1: (1.32, 1.32), 2: (1.12, 1.23), 4: (1.25, 1.11), 8: (1.25, 1.14)},
    ("cpu", "ngram-cache"): {1: (0.95, 1.05), 2: (1.02, 1.10), 4: (1.03, 0.96), 8: (0.92, 1.07)},
}
AUTO_MIN_GAIN = 1.10  # auto: at least this on copy-heavy work ...
AUTO_MAX_LOSS = 0.97  # ... and no worse than this on free generation


@dataclass(frozen=True)
class Speculation:
    """What a lane runs: a --spec-type, and the draft model for a draft kind."""

    spec_type: str
    draft: ModelFacts | None = None


def same_vocabulary(target: ModelFacts, draft: ModelFacts) -> str | None:
    """Why `draft` cannot draft for `target`, or None (llama-server checks the same: vocab type,
    size, and the tokens themselves, common_speculative_are_compatible)."""
    if not target.vocab_id or not draft.vocab_id:
        return "an agent too old to report vocabularies read one of them"
    if target.n_vocab != draft.n_vocab:
        return f"its vocabulary has {draft.n_vocab} tokens, {target.name}'s {target.n_vocab}"
    if target.vocab_id != draft.vocab_id:
        return f"its tokenizer differs from {target.name}'s ({draft.vocab_id} vs {target.vocab_id})"
    return None


def find_draft(target: ModelFacts, persona: Persona, models: Sequence[ModelFacts]) -> tuple[ModelFacts | None, str]:
    """The draft model and a reason: the persona's (refused when its vocabulary differs), else the
    smallest model on the host with the target's vocabulary."""
    if persona.draft is not None:
        named = next((m for m in models if m.name == persona.draft), None)
        if named is None:
            return None, f"draft {persona.draft} refused: no such model on this host"
        why = same_vocabulary(target, named)
        if why is not None:
            return None, f"draft {named.name} refused: {why}"
        return named, f"draft {named.name}: the persona names it"
    fitting = [
        m for m in models
        if m.name != target.name and m.weight_bytes < target.weight_bytes and same_vocabulary(target, m) is None
    ]  # fmt: skip
    if not fitting:
        return None, "no draft: no smaller model on this host shares its vocabulary"
    best = min(fitting, key=lambda m: (m.weight_bytes, m.name))
    return best, f"draft {best.name}: the smallest model here with {target.name}'s vocabulary ({target.n_vocab} tokens)"


def busy_figures(device: str, kind: str, slots: int) -> tuple[int, float, float] | None | str:
    """The figures that stand for a lane of `slots` slots all busy: the smallest measured count at
    or past them (the largest, beyond every count), as (count, copy-heavy, free); None where one
    slot needs none; a reason where the kind was never measured busy."""
    if slots <= 1:
        return None
    measured = MEASURED_BY_SLOTS.get((device, kind))
    if not measured:
        return f"{kind} was not measured with several slots busy"
    count = min((c for c in measured if c >= slots), default=max(measured))
    return (count, *measured[count])


def _loses_busy(device: str, kind: str, slots: int) -> str | None:
    """Why `kind` may not run on a lane of `slots` slots: at some measured count up to them it loses
    on free generation, or at its slot count it gains too little on copy-heavy work. None: it may."""
    at_slots = busy_figures(device, kind, slots)
    if at_slots is None:
        return None
    if isinstance(at_slots, str):
        return at_slots
    count, copy, free = at_slots
    for c, (_, f) in sorted(MEASURED_BY_SLOTS[(device, kind)].items()):
        if c <= count and f < AUTO_MAX_LOSS:
            return f"{kind} x{f:.2f} on free generation with {c} slots busy"
    if copy < AUTO_MIN_GAIN:
        return f"{kind} x{copy:.2f} on copy-heavy work with {count} slots busy"
    return None


def one_slot(device: str, kind: str) -> tuple[float, float] | None:
    """(copy-heavy, free) gains with one slot busy: the busy-slot run's where it measured the kind."""
    busy = MEASURED_BY_SLOTS.get((device, kind))
    return busy[1] if busy and 1 in busy else MEASURED.get((device, kind))


def _auto(device: str, draft: ModelFacts | None, available: Sequence[str], slots: int = 1) -> tuple[str | None, str]:
    """auto's choice for this kind of lane (its device and its slot count), from the benchmark's
    figures: a speculator that gains with one slot busy and loses nothing at any load up to all
    of the lane's slots."""
    gains, busy_losses = [], []
    kinds = sorted({k for d, k in (*MEASURED, *MEASURED_BY_SLOTS) if d == device})
    for kind in kinds:
        copy, free = one_slot(device, kind)
        if kind not in available or (kind in DRAFT_KINDS and draft is None):
            continue
        if copy >= AUTO_MIN_GAIN and free >= AUTO_MAX_LOSS:
            why_not = _loses_busy(device, kind, slots)
            if why_not is None:
                gains.append((copy, kind, free))
            else:
                busy_losses.append(why_not)
    if not gains:
        if busy_losses:
            return None, (f"speculative auto: off for a lane of {slots} slots, bench/spec_bench.py measured "
                          + "; ".join(busy_losses))  # fmt: skip
        seen = [f"{k} x{one_slot(device, k)[0]:.2f} copy-heavy, x{one_slot(device, k)[1]:.2f} free" for k in kinds]
        figures = "; ".join(seen) if seen else f"no figures for {device} lanes"
        return None, (f"speculative auto: off, bench/spec_bench.py measured no speculator on {device} lanes at"
                      f" x{AUTO_MIN_GAIN:.2f} copy-heavy without a loss below x{AUTO_MAX_LOSS:.2f} free ({figures})")  # fmt: skip
    copy, kind, free = max(gains)
    busy = busy_figures(device, kind, slots)
    said = "" if not isinstance(busy, tuple) else f"; with {busy[0]} slots busy x{busy[1]:.2f} and x{busy[2]:.2f}"
    said += "".join(f" (passed over: {why})" for why in busy_losses)
    return kind, (f"speculative auto: {kind}, bench/spec_bench.py measured x{copy:.2f} decode on copy-heavy"
                  f" work and x{free:.2f} on free generation on {device} lanes{said}")  # fmt: skip


def decide(
    persona: Persona, config: FleetConfig, facts: ModelFacts, models: Sequence[ModelFacts], caps: ServerCaps,
    device: str,
) -> tuple[Speculation | None, list[str]]:
    """The lane's speculation (None: off) and the reasons `lanes explain` shows."""
    mode = persona.speculative if persona.speculative is not None else config.speculative
    if mode == "off":
        return None, []
    if not caps.spec_types or "--spec-type" not in caps.spec_flags:
        return None, [f"speculative {mode}: off, this llama-server has no --spec-type"]
    reasons = []
    draft = None
    wants_draft = mode in DRAFT_KINDS or mode == "auto" or persona.draft is not None
    if wants_draft:
        if "--spec-draft-model" not in caps.spec_flags:
            reasons.append("no draft: this llama-server has no --spec-draft-model")
        else:
            draft, why = find_draft(facts, persona, models)
            reasons.append(why)
    if mode == "auto":
        kind, why = _auto(device, draft, caps.spec_types, persona.parallel)
        reasons.append(why)
        if kind is None:
            return None, reasons
        mode = kind
    if mode not in caps.spec_types:
        return None, reasons + [f"speculative {mode}: off, this llama-server's --spec-type lacks it"]
    if mode in DRAFT_KINDS and draft is None:
        return None, reasons + [f"speculative {mode}: off, it needs a draft model"]
    if mode not in DRAFT_KINDS:
        draft = None
    reasons.append(f"speculative decoding: --spec-type {mode}" + (f" with draft {draft.name}" if draft else ""))
    return Speculation(mode, draft), reasons
