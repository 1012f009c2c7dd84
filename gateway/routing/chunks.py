"""A prompt's chained chunk hashes (gateway/routing/affinity.py says where the scheme comes from). Pure.

hash(i) = H(chunk i, hash(i-1)), hash(-1) = H(model): a hash stands for the whole prefix up
to its chunk, so two prompts share hash i exactly when they share their first i+1 chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

CHUNK_CHARS = 256
MAX_CHUNKS = 512  # 128k characters (about 32k tokens): longer prompts match on this much


def chunk_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Fingerprint:
    """A prompt's chained chunk hashes, and the key that places it when no lane holds it."""

    hashes: tuple[int, ...]
    key: int  # the first chunk's hash, or the whole short text's
    chars: int = 0  # the rendered prompt's length: its tokens, at the lane's characters per token
    text: str = field(default="", repr=False, compare=False)  # the rendering, for `after`
    chunk: int = CHUNK_CHARS

    def after(self, chunks: int, chars: int) -> int | None:
        """The hash of the `chars` characters that follow its first `chunks` whole chunks (chained
        on the last of them); None where the text is shorter."""
        start = chunks * self.chunk
        if chunks <= 0 or chars <= 0 or start + chars > len(self.text):
            return None
        return chunk_hash(self.hashes[chunks - 1].to_bytes(8, "little") + self.text[start : start + chars].encode())

    def tail(self) -> tuple[int, int] | None:
        """(characters, hash) of what follows its last whole chunk: a lane sent this prompt holds
        that much more of the next turn, which repeats it (a conversation's previous prompt
        mostly ends inside a chunk: on a short prompt, most of what the lane holds)."""
        rest = len(self.text) - len(self.hashes) * self.chunk
        found = self.after(len(self.hashes), rest) if 0 < rest < self.chunk else None
        return None if found is None else (rest, found)


def fingerprint(model: str, text: str, chunk: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS) -> Fingerprint:
    seed = chunk_hash(model.encode())
    hashes: list[int] = []
    previous = seed
    whole = min(len(text) // chunk, max_chunks)
    for i in range(whole):
        previous = chunk_hash(previous.to_bytes(8, "little") + text[i * chunk : (i + 1) * chunk].encode())
        hashes.append(previous)
    key = hashes[0] if hashes else chunk_hash(seed.to_bytes(8, "little") + text.encode())
    return Fingerprint(tuple(hashes), key, len(text), text, chunk)
