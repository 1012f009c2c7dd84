"""Who asks and what they may use: the keys file and its tenants, their token limits summed
over every gateway, the fair order of their waiting requests, and the tokens an answer used."""

from gateway.tenants.fairness import Ledger, order
from gateway.tenants.keys import (
    CLASSES, PLAIN, PLAIN_ROLE, ROLES, KeysFile, Tenant, class_of, digest, parse, refusal_ceiling,
)
from gateway.tenants.quota import UsageBook
from gateway.tenants.usage import (
    PLAIN_BODY_BYTES, STREAM_TAIL_BYTES, AnswerReader, Usage, output_tokens, prompt_usage,
)

__all__ = [
    "CLASSES", "PLAIN", "PLAIN_BODY_BYTES", "PLAIN_ROLE", "ROLES", "AnswerReader", "STREAM_TAIL_BYTES",
    "KeysFile", "Ledger", "Tenant", "Usage", "UsageBook",
    "class_of", "digest", "order", "output_tokens", "parse", "prompt_usage", "refusal_ceiling",
]  # fmt: skip
