"""Which key a lane answers to, told without telling the key: its agent reports the fingerprint
with the lane's status (LaneStatus.key_id), and a gateway routes to the lane only once the key
it read from bucket lanes-secrets has that fingerprint. A lane restarted with a new key is
never sent the old one (llama-server would answer 401)."""

from __future__ import annotations

import hashlib

FINGERPRINT_CHARS = 16


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:FINGERPRINT_CHARS]
