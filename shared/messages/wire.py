"""The wire's vocabulary: the schema version, the bounded field types every message is made of,
the base of the tagged messages, and encode/decode."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

SCHEMA_VERSION = 2
# A reader accepts messages one schema version older or newer than its own (rolling upgrades).
SCHEMA_SKEW = 1
T = TypeVar("T")

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
FlashAttn = Literal["on", "off", "auto"]
# llama-server's --spec-type names lanes plans (shared/memory/speculative.py sizes each).
SpecType = Literal["draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]

# Every field of every message has a range (bus input is bounded): a value outside it fails the
# decode, and the reader logs the reason and drops the message.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PortOrNone = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: none
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**60)]  # up to 1 EiB
Int32 = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # model dimensions, token counts (llama.cpp's int32)
Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]  # restarts, requests, experts
Revision = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Pid = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
GpuIndex = Annotated[int, msgspec.Meta(ge=0, le=1023)]  # a GPU among the host's reported ones
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # a duration or age (about 31 years)
Label = Annotated[str, msgspec.Meta(max_length=256)]  # versions, backends, ids, addresses
Text = Annotated[str, msgspec.Meta(max_length=65536)]  # a reason, an error, a log line, a path, an argument
# llama-server's name for a device (--device): CUDA0, ROCm1, Vulkan0, MTL0, SYCL0, RPC0, RPC0[host:port].
_DEVICE = r"[A-Za-z][A-Za-z0-9_-]*(\[[A-Za-z0-9._:\[\]-]+\])?"
DeviceName = Annotated[str, msgspec.Meta(max_length=128, pattern=f"^{_DEVICE}$")]
# A ggml-rpc-server endpoint (--rpc): host:port, the host a name, an IPv4 address or [IPv6].
_ENDPOINT = r"([A-Za-z0-9][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}"
RpcEndpoint = Annotated[str, msgspec.Meta(pattern=f"^{_ENDPOINT}$")]
RpcEndpointOrNone = Annotated[str, msgspec.Meta(pattern=f"^({_ENDPOINT})?$")]  # "": none
# Tuple lengths: devices of a host or a lane, lines of text, things of a fleet.
FEW = msgspec.Meta(max_length=64)
LINES = msgspec.Meta(max_length=4096)
MANY = msgspec.Meta(max_length=100_000)
# A CPU as the kernel numbers it; the bound keeps a hostile plan from rendering a huge --cpu-mask.
CpuId = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class Message(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="kind"):
    schema: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = SCHEMA_VERSION


# The base of every tagged message, by its public name; the class keeps the name its schema and
# its default tag were recorded under (tests/golden/messages.json).


def schema_problem(msg: Message) -> str | None:
    """Why a message's schema version is too far from ours to trust, or None."""
    if abs(msg.schema - SCHEMA_VERSION) > SCHEMA_SKEW:
        return f"schema {msg.schema} is not within {SCHEMA_SKEW} of this reader's {SCHEMA_VERSION}; upgrade it"
    return None


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def decode(data: bytes | str, kind: type[T]) -> T:
    """Decode and validate; raises msgspec.ValidationError / DecodeError with the reason."""
    return msgspec.json.decode(data, type=kind)
