"""Why a request gets no lane: the HTTP edge turns each into an OpenAI error with its status and code."""

from __future__ import annotations


class AdmissionError(Exception):
    """A request that gets no lane; the HTTP edge turns it into an OpenAI error."""

    status = 503
    code = "unavailable"


class UnknownModel(AdmissionError):
    status = 404
    code = "model_not_found"


class QueueFull(AdmissionError):
    code = "queue_full"


class QueueTimeout(AdmissionError):
    code = "queue_timeout"


class Refused(AdmissionError):
    """Refused for its tenant or its class, before it used a slot: 429 with Retry-After and the reason."""

    status = 429

    def __init__(self, message: str, code: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.code, self.retry_after = code, retry_after
