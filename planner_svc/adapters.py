"""Which of a persona's LoRA adapters a lane on a host loads, and why not the others. Pure."""

from __future__ import annotations

from shared.messages.config import Persona
from shared.messages.hosts import AdapterFacts, HostReport, ModelFacts


def lane_adapters(persona: Persona, report: HostReport, facts: ModelFacts) -> tuple[tuple[AdapterFacts, ...], list[str]]:
    """The persona's adapters this host holds for this model, in the persona's order (a request's
    `lora` ids index the lane's list), and one reason per adapter left out or loaded."""
    if not persona.adapters:
        return (), []
    if report.server is not None and not report.server.has_lora:
        return (), [f"no LoRA adapters: this llama-server has no --lora-scaled ({', '.join(persona.adapters)} left out)"]
    found, reasons = [], []
    for name in dict.fromkeys(persona.adapters):
        held = [a for a in report.adapters if a.name == name]
        fitting = next((a for a in held if facts.name in a.bases), None)
        if fitting is None:
            reasons.append(f"adapter {name}: " + (f"does not fit {facts.name}" if held else "no such adapter file on this host"))
        elif "," in fitting.path or ":" in fitting.path:
            reasons.append(f"adapter {name}: its path has a comma or a colon, which --lora-scaled cannot take")
        else:
            found.append(fitting)
    if found:
        size = sum(lw.bytes for a in found for lw in a.layer_weights)
        reasons.append(f"LoRA adapters (--lora-scaled at 0, applied per request): {', '.join(a.name for a in found)}, {size / 2**20:.2f} MiB")
    return tuple(found), reasons


def reranks(persona: Persona, facts: ModelFacts) -> bool:
    """A reranking lane (--reranking): the persona says so, or else the GGUF declares rank pooling
    (llama.cpp's LLAMA_POOLING_TYPE_RANK, what converted rerankers carry)."""
    return persona.reranking if persona.reranking is not None else facts.pooling == "rank"


def pooled(persona: Persona, facts: ModelFacts, reranking_ok: bool = True) -> bool:
    """Whether the lane runs pooled (--reranking, or --embeddings as lane_specs.lane_spec decides it)."""
    if reranks(persona, facts) and reranking_ok:
        return True
    return persona.embeddings if persona.embeddings is not None else bool(facts.pooling)
