"""A built-in llama-server chat template for a model file that carries none. Pure.

A GGUF without `tokenizer.chat_template` is served with llama-server's ChatML fallback, which
a Gemma, Llama or Phi model does not know: the demo Gemma file answered the README's first
request with `<|im_end|>\\n<|im_start|>...`. llama-server has templates built in by name
(`--chat-template NAME`, listed in its --help), but with jinja on (the default on current
builds) a name is read as a jinja template of that literal text, so the name is passed with
`--no-jinja` before it (checked on b11434 with the real Gemma 3 file).
"""

from __future__ import annotations

from shared.messages.hosts import ModelFacts

# general.architecture -> llama-server's built-in template name (llama-chat.cpp LLM_CHAT_TEMPLATES).
_BY_ARCH = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "command-r": "command-r", "cohere2": "command-r",
    "chatglm": "chatglm4", "exaone": "exaone3", "exaone4": "exaone4",
    "granite": "granite", "granitemoe": "granite", "gpt-oss": "gpt-oss", "llama4": "llama4",
    "minicpm": "minicpm", "orion": "orion", "hunyuan-moe": "hunyuan-moe", "hunyuan-dense": "hunyuan-dense",
    "seed_oss": "seed_oss", "grok": "grok-2", "deepseek": "deepseek",
}  # fmt: skip
# Architectures shared by model families: the vocabulary size tells them apart.
_BY_VOCAB = {
    "llama": {128256: "llama3", 32000: "llama2", 32768: "mistral-v3", 131072: "mistral-v7-tekken"},
    "phi3": {32064: "phi3", 100352: "phi4"},
    "deepseek2": {129280: "deepseek3", 102400: "deepseek2"},
}


def builtin_template(facts: ModelFacts) -> str | None:
    """The built-in template for a file without its own; None: ChatML is right or nothing fits."""
    if facts.has_chat_template:
        return None
    return _BY_ARCH.get(facts.architecture) or _BY_VOCAB.get(facts.architecture, {}).get(facts.n_vocab)
