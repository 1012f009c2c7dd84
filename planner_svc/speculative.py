"""Speculative decoding for a lane: which speculator, which draft model, and why. Pure.

A persona's `speculative` (or the fleet's): `off`, a --spec-type, or `auto`, which turns on the
speculator bench/spec_bench.py measured fastest for that kind of lane, and only where it gained on
copy-heavy work without losing on free generation (MEASURED holds its figures). A draft model is
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


def _auto(device: str, draft: ModelFacts | None, available: Sequence[str]) -> tuple[str | None, str]:
    """auto's choice for this kind of lane, from the benchmark's figures."""
    gains = []
    for (dev, kind), (copy, free) in MEASURED.items():
        if dev != device or kind not in available or (kind in DRAFT_KINDS and draft is None):
            continue
        if copy >= AUTO_MIN_GAIN and free >= AUTO_MAX_LOSS:
            gains.append((copy, kind, free))
    if not gains:
        seen = [f"{k} x{c:.2f} copy-heavy, x{f:.2f} free" for (d, k), (c, f) in sorted(MEASURED.items()) if d == device]
        figures = "; ".join(seen) if seen else f"no figures for {device} lanes"
        return None, (f"speculative auto: off, bench/spec_bench.py measured no speculator on {device} lanes at"
                      f" x{AUTO_MIN_GAIN:.2f} copy-heavy without a loss below x{AUTO_MAX_LOSS:.2f} free ({figures})")  # fmt: skip
    copy, kind, free = max(gains)
    return kind, (f"speculative auto: {kind}, bench/spec_bench.py measured x{copy:.2f} decode on copy-heavy"
                  f" work and x{free:.2f} on free generation on {device} lanes")  # fmt: skip


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
        kind, why = _auto(device, draft, caps.spec_types)
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
