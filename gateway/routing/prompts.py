"""A request's prompt as the gateway sees it, and how many tokens it can at most be. Pure.

The gateway has no tokenizer and no chat template, so the prompt is a text rendering
of what the template will see: each chat message's role and content, in order (the
parts of a multi-part content that carry text; an image part by its URL, so two
pictures differ), the tools the request declares, or the completion's prompt text, or
the embedding input. Two requests whose renderings share a prefix share the prefix
of what llama-server tokenizes, which is all prefix affinity needs.

The token bound: every tokenizer llama-server runs (SentencePiece and byte-level BPE,
both with byte fallback) gives each token at least one byte of its input text, so
the UTF-8 bytes of the rendered template are an upper bound on its tokens. The
template adds role markers and special tokens around each message, which the gateway
cannot see: TEMPLATE_TOKENS_PER_MESSAGE and TEMPLATE_TOKENS covers them with room
(Gemma's `<start_of_turn>role\\n...<end_of_turn>\\n` is 5, Llama 3's header 4-5, its
dated system preamble about 25). The bound is only a screen: a prompt whose bound
passes a lane's window is counted exactly by that lane's /apply-template and
/tokenize before the gateway turns it away.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

TEMPLATE_TOKENS_PER_MESSAGE = 64
TEMPLATE_TOKENS = 128  # BOS, the generation prompt, a default system preamble

_RS, _US = "\x1e", "\x1f"  # record and unit separators: never ambiguous with message text


@dataclass(frozen=True)
class Prompt:
    """What a request asks the lane to read."""

    text: str  # the rendering the affinity hashes
    kind: str  # "chat" | "completion" | "embedding", or the path of an API the lane counts itself (OWN_COUNTERS)
    messages: tuple[dict, ...] = ()  # chat: the messages as sent (for /apply-template)
    extra_bytes: int = 0  # bytes the template renders beyond the text (tools, as JSON)

    def token_bound(self) -> int:
        """At least as many tokens as llama-server will count for this prompt."""
        per_message = TEMPLATE_TOKENS_PER_MESSAGE * max(1, len(self.messages))
        return len(self.text.encode()) + self.extra_bytes + per_message + TEMPLATE_TOKENS


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif isinstance(part.get("image_url"), dict):
                    parts.append(str(part["image_url"].get("url", "")))
                else:
                    parts.append(msgspec.json.encode(part).decode())
            else:
                parts.append(str(part))
        return _US.join(parts)
    return "" if content is None else msgspec.json.encode(content).decode()


def _message_text(message: dict) -> str:
    text = f"{message.get('role', '')}{_US}{_content_text(message.get('content'))}"
    calls = message.get("tool_calls")
    if calls:
        text += _US + msgspec.json.encode(calls).decode()
    return text


def prompt_of(path: str, payload: object) -> Prompt | None:
    """The prompt of a proxied request body, or None when it carries none the gateway can read."""
    if not isinstance(payload, dict):
        return None
    if path in OWN_COUNTERS:
        return _own_api_prompt(path, payload)
    if path == "/completion":  # llama-server's native completion: a prompt string
        value = payload.get("prompt")
        return Prompt(text=value, kind="completion") if isinstance(value, str) else None
    if path.endswith("/chat/completions"):
        messages = payload.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        tools = payload.get("tools")
        extra = len(msgspec.json.encode(tools)) if tools else 0
        text = "".join(_message_text(m) + _RS for m in messages)
        return Prompt(text=text, kind="chat", messages=tuple(messages), extra_bytes=extra)
    field = "prompt" if path.endswith("/completions") else "input" if path.endswith("/embeddings") else None
    if field is None:
        return None
    value = payload.get(field)
    kind = "completion" if field == "prompt" else "embedding"
    if isinstance(value, str):
        return Prompt(text=value, kind=kind)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return Prompt(text=_RS.join(value), kind=kind)
    return None  # token arrays and mixed inputs: nothing to hash or count


# Anthropic Messages and OpenAI Responses requests: each counted by the lane's own counter for
# that API (the rendering llama-server applies), not by /apply-template, which reads chat messages.
OWN_COUNTERS = {"/v1/messages": "/v1/messages/count_tokens", "/v1/responses": "/v1/responses/input_tokens"}


def _own_api_prompt(path: str, payload: dict) -> Prompt | None:
    """The rendering of a Messages request (system, then messages) or a Responses one
    (instructions, then input: a string or a list of items)."""
    head = payload.get("system") if path == "/v1/messages" else payload.get("instructions")
    items = payload.get("messages") if path == "/v1/messages" else payload.get("input")
    if isinstance(items, str) and path == "/v1/responses":  # Responses takes one string as the user's turn
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items or not all(isinstance(m, dict) for m in items):
        return None
    tools = payload.get("tools")
    extra = len(msgspec.json.encode(tools)) if tools else 0
    text = (_content_text(head) + _RS if head else "") + "".join(_message_text(m) + _RS for m in items)
    return Prompt(text=text, kind=path, messages=tuple(items), extra_bytes=extra)


def takes_images(path: str, payload: object) -> bool:
    """The request carries an image (a chat content part of type image_url): only a lane started
    with a projector (--mmproj) can read it."""
    if not isinstance(payload, dict) or not path.endswith("/chat/completions"):
        return False
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and (part.get("type") == "image_url" or "image_url" in part) for part in content
        ):
            return True
    return False
