"""A prompt's exact token count, asked of a lane of its model (the I/O behind window-aware admission).

Chat messages are rendered by the lane's own chat template (`POST /apply-template`
takes the chat request's body as it is, tools included) and the result tokenized with
special tokens parsed (`POST /tokenize`), as llama-server does before it checks a prompt
against its slot's window. Only a prompt whose byte bound (gateway/routing/prompts.py) passes
a window is counted, so the common case costs nothing.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from gateway.routing.prompts import OWN_COUNTERS, Prompt


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float, auth: dict[str, str]) -> object:
    async with session.post(url, data=body, headers={"Content-Type": "application/json", **auth},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:  # fmt: skip
        if resp.status != 200:
            raise ValueError(f"{url} answered {resp.status}")
        return msgspec.json.decode(await resp.read())


async def count_tokens(
    session: aiohttp.ClientSession, lane_url: str, prompt: Prompt, body: bytes, timeout: float = 5.0,
    auth: dict[str, str] | None = None,
) -> int | None:
    """Tokens llama-server will read for this prompt, or None when the lane could not say;
    `auth`: the headers that open the lane (LaneRoute.auth)."""
    auth = auth or {}
    try:
        if prompt.kind in OWN_COUNTERS:  # the lane's counter for that API renders it as the lane will
            counted = await _post(session, lane_url + OWN_COUNTERS[prompt.kind], body, timeout, auth)
            tokens = counted.get("input_tokens") if isinstance(counted, dict) else None
            return tokens if isinstance(tokens, int) and tokens >= 0 else None
        if prompt.kind == "chat":
            rendered = await _post(session, lane_url + "/apply-template", body, timeout, auth)
            text = rendered.get("prompt") if isinstance(rendered, dict) else None
            if not isinstance(text, str):
                return None
        else:
            text = prompt.text
        ask = msgspec.json.encode({"content": text, "add_special": True, "parse_special": True})
        answer = await _post(session, lane_url + "/tokenize", ask, timeout, auth)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return len(tokens) if isinstance(tokens, list) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, msgspec.DecodeError):
        return None
