"""What an operator can set on a gateway (`lanes gateway --help` has the same list)."""

from __future__ import annotations

import hmac
import ipaddress
import ssl
from dataclasses import dataclass

from shared import defaults

DEFAULT_PORT = defaults.GATEWAY_PORT


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 picks a free port (tests)
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    # The keys file (TOML, gateway/tenants/keys.py): each key's tenant, priority class, models and limits;
    # reread on change. With it, the api_keys above are tenant "default".
    keys_file: str | None = None
    critical_wait: float = defaults.CRITICAL_QUEUE_WAIT  # seconds a critical request waits for a slot
    fair: bool = True  # token-fair queueing between tenants; False: first come first served
    fair_half_life: float = defaults.FAIR_HALF_LIFE  # seconds after which consumed tokens count half
    output_weight: float = defaults.OUTPUT_WEIGHT  # an output token costs this many prompt tokens
    max_body_bytes: int = 16 * 2**20
    queue_depth: int = defaults.QUEUE_DEPTH  # waiting requests per model before 503
    queue_wait: float = defaults.QUEUE_WAIT  # seconds a request waits for a slot before 503
    request_timeout: float = 600.0  # whole request, lane answer included
    # Seconds a client connection may go without a whole request head (headers sent slowly, or
    # idle between requests: then it is closed) and a request may take to send its body (then
    # 408): a slow client (slowloris) holds a socket this long at most.
    client_timeout: float = 30.0
    connect_timeout: float = 3.0  # reaching a lane; past it the request goes to another lane
    # Connections opened to each lane ahead of its next streamed request (gateway/edge/lane_spares.py):
    # a new one waits for the lane's HTTP server to accept it, about 2.5 ms of its first byte. 0: none.
    lane_spares: int = 2
    # Seconds a streamed answer may take to its first token; past it the lane counts as stalled and
    # the request goes to another. None: from the prompt's size and the lane's measured prefill
    # speed, never under 30 s (gateway/routing/tries.py, first_byte_timeout).
    first_byte_timeout: float | None = None
    stream_idle_timeout: float = 120.0  # seconds with no byte mid-stream: the lane stalled
    slots_stall_after: float = 60.0  # seconds its agent found /slots unanswered: the lane stalled (gateway/sync/slots.py)
    probe_interval: float = 1.0  # seconds between the gateway's own /health checks of each lane
    probe_timeout: float = 1.0
    # Lanes probed per round at most (half for lanes out of rotation; gateway/fleet/probe.py): at
    # 256 a round the probes were most of an idle gateway's CPU with 30,000 lanes in its view, at 64
    # still most of its 1% (bench/gateway_idle.py).
    probe_budget: int = 32
    affinity: bool = True  # prefix affinity; False routes by most free slots alone
    shared_prefix: bool = True  # share the prefix index with every gateway over JetStream (docs/routing.md)
    kv_events: bool = False  # also publish it as vLLM KVEventBatch on lanes.kvevents.<host>.<lane>
    retry_after: int = 1  # seconds, in the Retry-After header of a 503
    admin_key: str | None = None  # set: the dashboard accepts fleet config changes from a viewer who has it
    # Models on demand (gateway/admission/waking.py): seconds a request for a model with no ready lane is
    # held while it loads, before 503 with Retry-After; None: the planner's predicted load time
    # plus a margin (waking.load_bound), 120 s where nothing is predicted.
    load_timeout: float | None = None
    # Names this gateway's activity reports (subject lanes.activity.<id>) and its NATS inbox prefix;
    # empty: its NATS user where it has one, else host name and pid.
    gateway_id: str = ""
    activity_interval: float = 2.0  # seconds between activity reports to the planner
    wake_repeat: float = 1.0  # seconds between repeated wakes while requests are held

    # Replicas of the usage bucket and prefix stream, where this gateway is the first and makes
    # them (--kv-replicas); None: those of the lanes bucket (the planner's --kv-replicas).
    kv_replicas: int | None = None

    # HTTPS (--https-cert/--https-key): the certificate chain and its private key (PEM files), both or
    # neither; with them the dashboard's session cookie is Secure. Behind a TLS proxy: docs/security.md.
    tls_cert: str | None = None
    tls_key: str | None = None

    # The operator's word that a gateway listening beyond loopback with no key is meant (--no-auth);
    # without it such a gateway refuses to start (lanes/online.py), with it it warns every hour.
    no_auth: bool = False
    # Web pages of which origins may call the gateway (llama-server's --cors-origins and its default:
    # "*" reflects any Origin; "localhost" reflects localhost ones only; else a comma-separated list).
    cors_origins: str = "*"

    def open_beyond_loopback(self) -> bool:
        """Whether anyone but this machine can reach it and no key guards it."""
        return not (self.api_keys or self.keys_file or listens_on_loopback(self.host))

    def tls_context(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None for plain HTTP; ssl.SSLError/OSError name a bad file."""
        if not self.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def key_ok(self, presented: str) -> bool:
        """Constant time over every configured key, so timing tells nothing of which matched."""
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(presented.encode(), key.encode())
        return ok


def listens_on_loopback(host: str) -> bool:
    """Only this machine can connect: localhost or a loopback address (a name that resolves
    elsewhere, or every interface, is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
