#!/usr/bin/env python3
"""A small stand-in for llama.cpp's `llama-server` (build b11434) for fast agent tests.

It takes the same argv as the real binary (see shared/llama/flags.py), refuses what the real
one refuses with the same messages and exit codes, reads the GGUF's own metadata and tensor
table with llama.cpp's gguf package (never through lanes' GGUF reader, which is under test),
and serves /health, /props, /v1/models, /slots, /metrics. It does not run a model.

The KV cache and compute buffer sizes it prints, and the context it serves, are
figures RECORDED FROM THE REAL BINARY (tests/llama_figures.json, written by
tests/record_llama_figures.py), never computed by the code under test: a shape with no
record is refused ("no figures recorded"). Old-build mode (one KV cache shared by all
slots, no SWA cache) prints the recorded figures of the same shape with a unified cache
and --swa-full, which hold the same cells.

Behaviour knobs (environment):
  FAKE_LLAMA_HELP_OLD=1        behave as an old (~b4879, March 2025) build: bare -fa switch,
                               no -kvu/-fit/--swa-full/-lm, has --no-mmap/--mlock, one KV cache
                               shared by all slots, no separate SWA cache, `KV self size` line
  FAKE_LLAMA_BUILD=N           build number for --version and build_info (11434; old: 4879)
  FAKE_LLAMA_CACHE_TYPES=a,b   the only KV cache types this build accepts (and lists in --help)
  FAKE_LLAMA_KV_SCALE=F        print KV sizes F times what the memory model says (a build whose
                               cache outgrows the plan)
  FAKE_LLAMA_REFUSE_TYPES=a,b  types --help still lists but the build refuses at start (a binary
                               swapped under a running agent, or a distro build that lies)
  FAKE_LLAMA_LOAD_SECONDS=S    how long /health answers 503 "Loading model" (0.3)
  FAKE_LLAMA_REPLY_SECONDS=S   how long each completion takes to answer (0: at once)
  FAKE_LLAMA_ALLOC=1           allocate and touch memory the size of the KV cache
  FAKE_LLAMA_OOM_ABOVE_CTX=N   fail to allocate the KV cache when the total context is > N
  FAKE_LLAMA_CRASH_AFTER=S     exit 139 ("Segmentation fault") S seconds after becoming healthy
  FAKE_LLAMA_CRASH_SIGNAL=1    with CRASH_AFTER: die of a real SIGSEGV instead of exit(139)
  FAKE_LLAMA_STALL=1           the first completion stops the inference loop for good (a stuck
                               decode): it never answers and its slot stays busy with the counters
                               the real binary showed mid-prefill, never moving; the endpoints go on
                               answering as the real binary's did while its loop was busy
                               (tests/llama_busy_loop.json, recorded by bench/busy_loop_probe.py:
                               all of them answered within 0.1 s; one recorded as answered by the
                               loop would answer nothing)
  FAKE_LLAMA_LOG_PREFIX=0      drop the `0.00.153.786 I ` time/level prefix of log lines
                               (new builds print it; old builds never do)
  FAKE_LLAMA_RECORD_TO=FILE    (recording only) a shape with no record is appended to FILE
                               and served from shared.memory's model (its KV caches and CPU
                               compute buffer), so record_llama_figures.py can then measure
                               it with the real binary
Also honoured like the real binary: LLAMA_ARG_{MODEL,ALIAS,HOST,PORT,CTX_SIZE,N_PARALLEL,
N_GPU_LAYERS,CACHE_TYPE_K,CACHE_TYPE_V,FLASH_ATTN} (the command line wins).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_REPO = str(Path(__file__).resolve().parent.parent)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# gguf (numpy) is imported only once a model is to be loaded, so --help, --version and argument
# errors work under any python3. Nothing of lanes is imported outside recording mode.
MIB = 1024 * 1024
QUANTIZED = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})

_START = time.monotonic()
OLD = os.environ.get("FAKE_LLAMA_HELP_OLD", "") not in ("", "0")
BUILD = int(os.environ.get("FAKE_LLAMA_BUILD") or (4879 if OLD else 11434))
COMMIT = "deadbeef"
ALL_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
LOG_PREFIX = not OLD and os.environ.get("FAKE_LLAMA_LOG_PREFIX", "1") not in ("", "0")


def _cache_types() -> tuple[str, ...]:
    raw = os.environ.get("FAKE_LLAMA_CACHE_TYPES", "").strip()
    if not raw:
        return ALL_CACHE_TYPES
    wanted = [t.strip() for t in raw.split(",") if t.strip()]
    return tuple(t for t in wanted if t in ALL_CACHE_TYPES)


CACHE_TYPES = _cache_types()


# ---------------------------------------------------------------------------- output


def _write(fd: int, text: str) -> None:
    """One write(2) per call: unbuffered, so a supervisor sees each line at once."""
    data = text.encode("utf-8", "replace")
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return
        data = data[n:]


def raw(line: str) -> None:
    """A line printed with fprintf(stderr) (argument errors, --version): no log prefix."""
    _write(2, line + "\n")


def log(level: str, line: str) -> None:
    """A line through llama.cpp's common log: `M.SS.mmm.uuu L text` on new builds."""
    if LOG_PREFIX:
        us = int((time.monotonic() - _START) * 1_000_000)
        stamp = f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"
        _write(2, f"{stamp} {level} {line}\n")
    else:
        _write(2, line + "\n")


def die(code: int = 1) -> None:
    os._exit(code)


# ---------------------------------------------------------------------------- help

_HELP_COL = 40
_HELP_WIDTH = 70


class Opt:
    def __init__(self, names, hint, desc, env=None, key=None, handler=None, const=None):
        self.names = tuple(names)
        self.hint = hint  # None: a switch
        self.desc = desc
        self.env = env
        self.key = key
        self.handler = handler
        self.const = const

    def usage(self) -> str:
        first, rest = self.names[0], self.names[1:]
        left = (f"{first + ', ':<7}" + ", ".join(rest)) if rest else first
        if self.hint:
            left += " " + self.hint
        lines: list[str] = []
        for para in self.desc.split("\n"):
            lines += textwrap.wrap(para, _HELP_WIDTH) or [""]
        if self.env:
            lines.append(f"(env: {self.env})")
        pad_ = " " * _HELP_COL
        if len(left) < _HELP_COL:
            out = [f"{left:<{_HELP_COL}}{lines[0]}"] + [pad_ + line for line in lines[1:]]
        else:
            out = [left] + [pad_ + line for line in lines]
        return "\n".join(out)


class ArgError(Exception):
    pass


def _int(value: str) -> int:
    try:
        return int(value.strip(), 10)
    except ValueError:
        raise ArgError("stoi") from None


_TRUTHY = {"on", "enabled", "true", "1"}
_FALSEY = {"off", "disabled", "false", "0"}
_AUTOY = {"auto", "-1"}


def _flash_attn(value: str) -> str:
    if value in _TRUTHY:
        return "on"
    if value in _FALSEY:
        return "off"
    if value in _AUTOY:
        return "auto"
    raise ArgError(f"error: unknown value for --flash-attn: '{value}'\n")


def _fit(value: str) -> str:
    if value in _TRUTHY:
        return "on"
    if value in _FALSEY:
        return "off"
    raise ArgError(f"error: unknown value for --fit: '{value}'\n")


def _cache_type(value: str) -> str:
    refused = os.environ.get("FAKE_LLAMA_REFUSE_TYPES", "").split(",")
    if value not in CACHE_TYPES or value in refused:
        raise ArgError(f"Unsupported cache type: {value}")
    return value


def _ngl(value: str):
    if not OLD and value in ("auto", "all"):
        return value
    return _int(value)


def _cpu_range(value: str) -> str:
    lo, dash, hi = value.partition("-")
    if not dash:
        raise ArgError("invalid range")
    for end in (lo, hi):
        if end and (not end.isdigit() or int(end) >= 512):  # GGML_MAX_N_THREADS
            raise ArgError("invalid range")
    return value


def _cpu_mask(value: str) -> str:
    digits = value[2:] if value.startswith("0x") else value
    if any(c not in "0123456789abcdefABCDEF" for c in digits):
        raise ArgError("invalid cpumask")
    return value


def _load_mode(value: str) -> str:
    if value not in ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"):
        raise ArgError(f"error: unknown value for --load-mode: '{value}'\n")
    return value


def _options() -> list[Opt]:
    types = ", ".join(CACHE_TYPES)
    o: list[Opt] = [
        Opt(["-h", "--help", "--usage"], None, "print usage and exit", key="help", const=True),
        Opt(["--version"], None, "show version and build info", key="version", const=True),
        Opt(["-t", "--threads"], "N", "number of CPU threads to use during generation (default: -1)",
            "LLAMA_ARG_THREADS", "threads", _int),
        Opt(["-tb", "--threads-batch"], "N",
            "number of threads to use during batch and prompt processing (default: same as --threads)",
            "LLAMA_ARG_THREADS_BATCH", "threads_batch", _int),
        Opt(["-C", "--cpu-mask"], "M", 'CPU affinity mask: arbitrarily long hex. Complements cpu-range (default: "")',
            None, "cpu_mask", _cpu_mask),
        Opt(["-Cr", "--cpu-range"], "lo-hi", "range of CPUs for affinity. Complements --cpu-mask",
            None, "cpu_range", _cpu_range),
        Opt(["--cpu-strict"], "<0|1>", "use strict CPU placement (default: 0)", None, "cpu_strict", _int),
        Opt(["--poll"], "<0...100>", "use polling level to wait for work (0 - no polling, default: 50)",
            None, "poll", _int),
        Opt(["-Cb", "--cpu-mask-batch"], "M",
            "CPU affinity mask: arbitrarily long hex. Complements cpu-range-batch (default: same as --cpu-mask)",
            None, "cpu_mask_batch", _cpu_mask),
        Opt(["-Crb", "--cpu-range-batch"], "lo-hi", "ranges of CPUs for affinity. Complements --cpu-mask-batch",
            None, "cpu_range_batch", _cpu_range),
        Opt(["--cpu-strict-batch"], "<0|1>", "use strict CPU placement (default: same as --cpu-strict)",
            None, "cpu_strict_batch", _int),
        Opt(["--poll-batch"], "<0|1>", "use polling to wait for work (default: same as --poll)",
            None, "poll_batch", _int),
        Opt(["-c", "--ctx-size"], "N",
            f"size of the prompt context (default: {4096 if OLD else 0}, 0 = loaded from model)",
            "LLAMA_ARG_CTX_SIZE", "ctx", _int),
        Opt(["-n", "--predict", "--n-predict"], "N", "number of tokens to predict (default: -1, -1 = infinity)",
            "LLAMA_ARG_N_PREDICT", "n_predict", _int),
        Opt(["-b", "--batch-size"], "N", "logical maximum batch size (default: 2048)",
            "LLAMA_ARG_BATCH", "n_batch", _int),
        Opt(["-ub", "--ubatch-size"], "N", "physical maximum batch size (default: 512)",
            "LLAMA_ARG_UBATCH", "n_ubatch", _int),
        Opt(["--keep"], "N", "number of tokens to keep from the initial prompt (default: 0, -1 = all)",
            None, "keep", _int),
    ]
    if not OLD:
        o += [
            Opt(["--swa-full"], None, "use full-size SWA cache (default: false)", "LLAMA_ARG_SWA_FULL",
                "swa_full", const=True),
            Opt(["-kvu", "--kv-unified"], None,
                "use single unified KV buffer shared across all sequences (default: enabled if number "
                "of slots is auto)", "LLAMA_ARG_KV_UNIFIED", "kv_unified", const=True),
            Opt(["-no-kvu", "--no-kv-unified"], None, "use separate KV buffers for each sequence",
                None, "kv_unified", const=False),
            Opt(["-fa", "--flash-attn"], "[on|off|auto]",
                "set Flash Attention use ('on', 'off', or 'auto', default: 'auto')",
                "LLAMA_ARG_FLASH_ATTN", "flash_attn", _flash_attn),
        ]
    else:
        o += [
            Opt(["-fa", "--flash-attn"], None, "enable Flash Attention (default: disabled)",
                "LLAMA_ARG_FLASH_ATTN", "flash_attn", const="on"),
        ]
    o += [
        Opt(["--no-perf"], None, "disable internal libllama performance timings (default: false)",
            "LLAMA_ARG_NO_PERF", "no_perf", const=True),
        Opt(["-ctk", "--cache-type-k"], "TYPE",
            f"KV cache data type for K\nallowed values: {types}\n(default: f16)",
            "LLAMA_ARG_CACHE_TYPE_K", "cache_type_k", _cache_type),
        Opt(["-ctv", "--cache-type-v"], "TYPE",
            f"KV cache data type for V\nallowed values: {types}\n(default: f16)",
            "LLAMA_ARG_CACHE_TYPE_V", "cache_type_v", _cache_type),
        Opt(["-np", "--parallel"], "N",
            "number of parallel sequences to decode (default: 1)" if OLD
            else "number of server slots (default: -1, -1 = auto)",
            "LLAMA_ARG_N_PARALLEL", "parallel", _int),
        Opt(["-cb", "--cont-batching"], None, "enable continuous batching (default: enabled)",
            "LLAMA_ARG_CONT_BATCHING", "cont_batching", const=True),
        Opt(["-nocb", "--no-cont-batching"], None, "disable continuous batching",
            "LLAMA_ARG_NO_CONT_BATCHING", "cont_batching", const=False),
    ]
    if OLD:
        o += [
            Opt(["--mlock"], None, "force system to keep model in RAM rather than swapping or compressing",
                "LLAMA_ARG_MLOCK", "mlock", const=True),
            Opt(["--no-mmap"], None, "do not memory-map model (slower load but may reduce pageouts if not "
                "using mlock)", "LLAMA_ARG_NO_MMAP", "no_mmap", const=True),
        ]
    else:
        o += [
            Opt(["-lm", "--load-mode"], "MODE",
                "model loading mode: auto, none, mmap, mlock, mmap+mlock, dio (default: auto)",
                "LLAMA_ARG_LOAD_MODE", "load_mode", _load_mode),
        ]
    o += [
        Opt(["-dev", "--device"], "<dev1,dev2,..>",
            "comma-separated list of devices to use for offloading (none = don't offload)",
            "LLAMA_ARG_DEVICE", "device"),
        Opt(["-ngl", "--gpu-layers", "--n-gpu-layers"], "N",
            "number of layers to store in VRAM" if OLD
            else "max. number of layers to store in VRAM, either an exact number, 'auto', or 'all' "
            "(default: auto)",
            "LLAMA_ARG_N_GPU_LAYERS", "n_gpu_layers", _ngl),
        Opt(["-sm", "--split-mode"], "{none,layer,row}", "how to split the model across multiple GPUs",
            "LLAMA_ARG_SPLIT_MODE", "split_mode"),
        Opt(["-ts", "--tensor-split"], "N0,N1,N2,...", "fraction of the model to offload to each GPU",
            "LLAMA_ARG_TENSOR_SPLIT", "tensor_split"),
        Opt(["-mg", "--main-gpu"], "INDEX", "the GPU to use for the model (default: 0)",
            "LLAMA_ARG_MAIN_GPU", "main_gpu", _int),
    ]
    if not OLD:
        o += [
            Opt(["-fit", "--fit"], "[on|off]",
                "whether to adjust unset arguments to fit in device memory ('on' or 'off', default: 'on')",
                "LLAMA_ARG_FIT", "fit", _fit),
        ]
    o += [
        Opt(["-m", "--model"], "FNAME", "model path to load", "LLAMA_ARG_MODEL", "model"),
        Opt(["-a", "--alias"], "STRING", "set alias for model name (to be used by REST API)",
            "LLAMA_ARG_ALIAS", "alias"),
        Opt(["--host"], "HOST", "ip address to listen, or bind to an UNIX socket if the address ends with "
            ".sock (default: 127.0.0.1)", "LLAMA_ARG_HOST", "host"),
        Opt(["--port"], "PORT", "port to listen (default: 8080)", "LLAMA_ARG_PORT", "port", _int),
        Opt(["--api-key"], "KEY", "API key to use for authentication (default: none)", "LLAMA_API_KEY",
            "api_key"),
        Opt(["--api-key-file"], "FNAME", "path to file containing API keys (default: none)", None, "api_key_file"),
        Opt(["--threads-http"], "N", "number of threads used to process HTTP requests (default: -1)",
            "LLAMA_ARG_THREADS_HTTP", "threads_http", _int),
        Opt(["-to", "--timeout"], "N", "server read/write timeout in seconds (default: 600)",
            "LLAMA_ARG_TIMEOUT", "timeout", _int),
        Opt(["--metrics"], None, "enable prometheus compatible metrics endpoint (default: disabled)",
            "LLAMA_ARG_ENDPOINT_METRICS", "metrics", const=True),
        Opt(["--slots"], None, "enable slots monitoring endpoint (default: enabled)",
            "LLAMA_ARG_ENDPOINT_SLOTS", "slots", const=True),
        Opt(["--no-slots"], None, "disables slots monitoring endpoint", "LLAMA_ARG_NO_ENDPOINT_SLOTS",
            "slots", const=False),
        Opt(["--no-webui"], None, "Disable the Web UI (default: enabled)", "LLAMA_ARG_NO_WEBUI",
            "webui", const=False),
        Opt(["--jinja"], None, "use jinja template for chat (default: disabled)", "LLAMA_ARG_JINJA",
            "jinja", const=True),
        Opt(["--no-warmup"], None, "skip warming up the model with an empty run", None, "warmup", const=False),
        Opt(["--log-disable"], None, "Log disable", None, "log_disable", const=True),
        Opt(["--log-file"], "FNAME", "Log to file", None, "log_file"),
        Opt(["--log-prefix"], None, "Enable prefix in log messages", "LLAMA_LOG_PREFIX", "log_prefix",
            const=True),
        Opt(["--log-timestamps"], None, "Enable timestamps in log messages", "LLAMA_LOG_TIMESTAMPS",
            "log_timestamps", const=True),
        Opt(["-v", "--verbose", "--log-verbose"], None,
            "Set verbosity level to infinity (i.e. log all messages, useful for debugging)", None,
            "verbosity", const=99),
        Opt(["-lv", "--verbosity", "--log-verbosity"], "N",
            "Set the verbosity threshold. Messages with a higher verbosity will be ignored. Values:\n"
            " - 0: generic output\n - 1: error\n - 2: warning\n - 3: info\n - 4: debug\n(default: 3)",
            "LLAMA_LOG_VERBOSITY", "verbosity", _int),
    ]
    return o


OPTIONS = _options()
BY_NAME = {name: opt for opt in OPTIONS for name in opt.names}


def help_text() -> str:
    head = "----- common params -----\n\n"
    return head + "\n".join(opt.usage() for opt in OPTIONS) + "\n\n\nexample usage:\n\n" \
        "    llama-server -m model.gguf --port 8080\n"


def print_version() -> None:
    raw(f"version: {BUILD} ({COMMIT})")
    raw("built with cc (GCC) 13.2.0 for x86_64-linux-gnu")


# ---------------------------------------------------------------------------- argv


def default_params() -> dict:
    return {
        "model": None,
        "alias": None,
        "host": "127.0.0.1",
        "port": 8080,
        "ctx": 4096 if OLD else 0,
        "parallel": None,  # new builds: auto (4 slots, unified KV); old builds: 1
        "kv_unified": False,
        "swa_full": False,
        "cache_type_k": "f16",
        "cache_type_v": "f16",
        "flash_attn": "off" if OLD else "auto",
        "fit": "on",
        "n_gpu_layers": -1,
        "n_ubatch": 512,
        "n_batch": 2048,
        "verbosity": 3,
        "metrics": False,
        "slots": True,
    }


def _arg_error(arg: str, msg: str, opt: Opt | None) -> None:
    raw(f'error while handling argument "{arg}": {msg.rstrip()}\n')
    if opt is not None:
        raw(f"usage:\n{opt.usage()}\n\n")
    raw("to show complete usage, run with -h")
    die(1)


def parse_args(argv: list[str]) -> dict:
    params = default_params()
    # Environment first (LLAMA_ARG_*), the command line overrides it.
    for opt in OPTIONS:
        if opt.env and opt.hint and opt.env in os.environ and opt.key:
            value = os.environ[opt.env]
            try:
                params[opt.key] = opt.handler(value) if opt.handler else value
            except ArgError as exc:
                _arg_error(opt.env, str(exc), opt)
    i = 0
    while i < len(argv):
        arg = argv[i]
        opt = BY_NAME.get(arg)
        if opt is None:
            raw(f"error: invalid argument: {arg}")
            die(1)
        if opt.hint is None:
            if opt.key == "version":
                print_version()
                die(0)
            params[opt.key] = opt.const
            if opt.key == "kv_unified":
                params["kv_unified_set"] = True
            i += 1
            continue
        if i + 1 >= len(argv):
            _arg_error(arg, "expected value for argument", opt)
        value = argv[i + 1]
        try:
            params[opt.key] = opt.handler(value) if opt.handler else value
        except ArgError as exc:
            _arg_error(arg, str(exc), opt)
        if opt.key == "parallel":
            params["parallel_set"] = True
        i += 2
    return params


# ---------------------------------------------------------------------------- state


class State:
    loading = True
    params: dict = {}
    model_path = ""
    alias = ""
    n_slots = 1
    n_ctx = 0  # llama_n_ctx
    n_ctx_slot = 0
    n_ctx_train = 0
    n_params = 0
    size = 0
    n_vocab = 0
    n_embd = 0
    keep: list = []
    api_keys: frozenset = frozenset()  # --api-key and --api-key-file: empty, every request is answered


STATE = State()

_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
_NOT_FOUND = {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}
# With keys, every path but these needs one, loading or not (b11434, measured: /models, /props,
# /slots, /metrics, /tokenize and slot save/erase answer 401 without it).
_PUBLIC = ("/health", "/v1/health")
_BAD_KEY = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llama.cpp"
    sys_version = ""

    def log_message(self, format, *args):  # noqa: A002 - quiet: the real server logs requests at debug only
        pass

    def _send(self, code: int, body, content_type: str = "application/json; charset=utf-8") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Access-Control-Allow-Origin", "*")
        if self.close_connection:  # asked `Connection: close`: the binary says so and closes (b11434, measured)
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _key_ok(self) -> bool:
        given = self.headers.get("X-Api-Key") or ""
        bearer = self.headers.get("Authorization") or ""
        if bearer.startswith("Bearer "):
            given = bearer[len("Bearer "):]
        return given in STATE.api_keys

    def _route(self) -> None:
        if STATE.api_keys and self.path.split("?", 1)[0] not in _PUBLIC and not self._key_ok():
            self._send(401, _BAD_KEY)
            return
        if STATE.loading:
            self._send(503, _LOADING)
            return
        path = self.path.split("?", 1)[0]
        if _LOOP_STOPPED.is_set() and path in _answered_by_loop():
            threading.Event().wait()  # queued for a loop that never comes round: no answer, ever
        route = _GET_ROUTES if self.command in ("GET", "HEAD") else _POST_ROUTES
        fn = route.get(path)
        if fn is None:
            self._send(404, _NOT_FOUND)
            return
        code, body, *ctype = fn()
        self._send(code, body, *ctype)

    def do_GET(self):  # noqa: N802
        self._route()

    def do_HEAD(self):  # noqa: N802
        self._route()

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path.endswith("/chat/completions"):
            _log_prompt(body)
        self._route()


def _log_prompt(body: bytes) -> None:
    """As the binary at verbosity 4: each chat's formatted prompt, over several lines, at debug level."""
    try:
        messages = json.loads(body).get("messages") or []
    except (ValueError, AttributeError):
        return
    text = "".join(f"<|{m.get('role')}|>\n{m.get('content')}\n" for m in messages if isinstance(m, dict))
    log("D", f"srv  params_from_: formatted_chat: '{text}'")


_PROCESSING = [0]  # completions being answered now: /slots shows that many slots busy, as the binary does
_PROCESSING_LOCK = threading.Lock()


def _slot(i: int) -> dict:
    slot = {
        "id": i,
        "id_task": -1,
        "n_ctx": STATE.n_ctx_slot,
        "speculative": False,
        "is_processing": i < _PROCESSING[0],
        "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
    }
    if i == 0 and _LOOP_STOPPED.is_set():  # the stuck request's slot, as recorded mid-prefill, frozen
        recorded = json.loads(BUSY_LOOP.read_text())["slot_during_prefill"]
        slot.update({k: recorded[k] for k in ("id_task", "n_prompt_tokens", "n_prompt_tokens_processed",
                                              "next_token")})  # fmt: skip
    return slot


def _health():
    return 200, {"status": "ok"}


def _props():
    props = {
        "default_generation_settings": _slot(0),
        "total_slots": STATE.n_slots,
        "model_alias": STATE.alias,
        "model_path": STATE.model_path,
        "modalities": {"vision": False, "audio": False},
        "chat_template": "",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "build_info": f"b{BUILD}-{COMMIT}",
    }
    if not OLD:
        props["is_sleeping"] = False
        props["webui"] = STATE.params.get("webui", True)
    return 200, props


def _models():
    meta = {
        "vocab_type": 1,
        "n_vocab": STATE.n_vocab,
        "n_ctx_train": STATE.n_ctx_train,
        "n_embd": STATE.n_embd,
        "n_params": STATE.n_params,
        "size": STATE.size,
    }
    if not OLD:
        meta["n_ctx"] = STATE.n_ctx
    model_id = STATE.params.get("alias") or STATE.model_path
    entry = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "llamacpp", "meta": meta}
    return 200, {
        "models": [{"name": model_id, "model": model_id, "type": "model", "capabilities": ["completion"]}],
        "object": "list",
        "data": [entry],
    }


def _slots():
    if not STATE.params.get("slots", True):
        return 501, {"error": {"code": 501, "message": "This server does not support slots endpoint. "
                               "Start it with `--slots`", "type": "not_supported_error"}}
    return 200, [_slot(i) for i in range(STATE.n_slots)]


def _metrics():
    if not STATE.params.get("metrics"):
        return 501, {"error": {"code": 501, "message": "This server does not support metrics endpoint. "
                               "Start it with `--metrics`", "type": "not_supported_error"}}
    lines = []
    for name, kind, value in (
        ("prompt_tokens_total", "counter", 0),
        ("prompt_seconds_total", "counter", 0),
        ("tokens_predicted_total", "counter", 0),
        ("tokens_predicted_seconds_total", "counter", 0),
        ("n_decode_total", "counter", 0),
        ("n_busy_slots_per_decode", "counter", 0),
        ("prompt_tokens_seconds", "gauge", 0),
        ("predicted_tokens_seconds", "gauge", 0),
        ("requests_processing", "gauge", 0),
        ("requests_deferred", "gauge", 0),
    ):
        lines += [f"# HELP llamacpp:{name} {name}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return 200, "\n".join(lines) + "\n", "text/plain; version=0.0.4"


def _reply_delay() -> None:
    """An answer that takes time holds a slot meanwhile (the agent's drain waits on /slots)."""
    delay = float(os.environ.get("FAKE_LLAMA_REPLY_SECONDS", "0") or 0)
    if delay > 0:
        with _PROCESSING_LOCK:
            _PROCESSING[0] += 1
        try:
            time.sleep(delay)
        finally:
            with _PROCESSING_LOCK:
                _PROCESSING[0] -= 1


_LOOP_STOPPED = threading.Event()
BUSY_LOOP = Path(__file__).with_name("llama_busy_loop.json")


def _answered_by_loop() -> frozenset[str]:
    """The endpoints the real binary answers from its inference loop, as recorded (never guessed)."""
    return frozenset(json.loads(BUSY_LOOP.read_text())["answered_by_loop"])


def _stall() -> None:
    """FAKE_LLAMA_STALL: this request's decode never ends, and the loop with it."""
    if os.environ.get("FAKE_LLAMA_STALL", "") in ("", "0"):
        return
    with _PROCESSING_LOCK:
        _PROCESSING[0] += 1
    _LOOP_STOPPED.set()
    threading.Event().wait()


def _completion():
    _stall()
    _reply_delay()
    return 200, {"content": "fake", "stop": True, "tokens_predicted": 1, "tokens_evaluated": 1,
                 "model": STATE.alias}


def _chat():
    _stall()
    _reply_delay()
    return 200, {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": STATE.alias,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "fake"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


_GET_ROUTES = {
    "/health": _health,
    "/v1/health": _health,
    "/props": _props,
    "/models": _models,
    "/v1/models": _models,
    "/slots": _slots,
    "/metrics": _metrics,
}
_POST_ROUTES = {
    "/completion": _completion,
    "/completions": _completion,
    "/v1/completions": _completion,
    "/chat/completions": _chat,
    "/v1/chat/completions": _chat,
}


class Server(ThreadingHTTPServer):
    daemon_threads = True


class Server6(Server):
    address_family = socket.AF_INET6


# ---------------------------------------------------------------------------- startup


FIGURES = Path(__file__).with_name("llama_figures.json")
def model_facts(path: str) -> dict:
    """What the fake needs of a model, read as the real binary reads it: the file's own metadata
    keys and tensor table (llama.cpp's gguf package), no rule of lanes' in between. `key` names
    the model in the recorded table by what sizes its buffers: its architecture's metadata and its
    tensors' names, shapes and types (not its path, name or file time)."""
    import hashlib

    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields["general.architecture"]

    def first(value):
        return value[0] if isinstance(value, list) else value

    def get(name: str, default=0):
        value = fields.get(f"{arch}.{name}")
        return default if value is None else value

    n_embd, n_head = int(get("embedding_length")), int(first(get("attention.head_count")))
    head_dim = n_embd // n_head if n_head else 0
    tokens = fields.get("tokenizer.ggml.tokens")
    tensors = sorted((t.name, [int(x) for x in t.shape], int(t.tensor_type)) for t in reader.tensors)
    shape = {k: v for k, v in fields.items() if k.startswith(f"{arch}.")}
    digest = hashlib.sha256(json.dumps([arch, shape, tensors], sort_keys=True, default=str).encode()).hexdigest()
    return {
        "key": f"{arch}-{digest[:16]}",
        "architecture": arch,
        "n_ctx_train": int(get("context_length")),
        "n_embd": n_embd,
        "n_layer": int(get("block_count")),
        "n_head": n_head,
        "n_head_kv": int(first(get("attention.head_count_kv", n_head))),
        "n_swa": int(get("attention.sliding_window") or 0),
        "n_vocab": len(tokens) if isinstance(tokens, list) else int(get("vocab_size")),
        "head_dim_k": int(get("attention.key_length", head_dim)),
        "head_dim_v": int(get("attention.value_length", head_dim)),
        "weight_bytes": sum(int(t.n_bytes) for t in reader.tensors),
        "n_params": sum(int(t.n_elements) for t in reader.tensors),
    }


def figures_key(model: dict, **shape) -> str:
    """One lane shape on one model (model_facts), as the recorded table names it."""
    return f"{model['key']}|" + "|".join(f"{k}={shape[k]}" for k in sorted(shape))


def pad(n: int, to: int = 256) -> int:
    """llama-server pads the context to a multiple of 256."""
    return -(-n // to) * to


def recorded_figures(key: str, argv: list[str], model_path: str) -> dict | None:
    """The real binary's figures for this shape; None only in recording mode."""
    table = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    if key in table:
        return table[key]
    record_to = os.environ.get("FAKE_LLAMA_RECORD_TO")
    if record_to:
        with open(record_to, "a") as f:
            f.write(json.dumps({"key": key, "argv": argv, "model": model_path}) + "\n")
        return None
    _fail_load(model_path, f"fake llama-server: no figures recorded from the real llama-server for {key}; "
               "run tests/record_llama_figures.py (see its docstring)")


def _computed_figures(model_path: str, *, swa_full: bool, **shape) -> dict:
    """Recording mode only: the memory model's figures (its KV caches and its CPU compute buffer,
    shared.memory), so a test run can reach every shape until the real binary's are recorded."""
    from shared.gguf_facts import read_model_facts
    from shared.memory import LaneShape, kv_caches, kv_size, lane_memory

    facts = read_model_facts(model_path)
    lane = LaneShape(**shape)
    kv = kv_size(facts, ctx=lane.ctx, parallel=lane.parallel, kv_unified=lane.kv_unified, type_k=lane.type_k,
                 type_v=lane.type_v, n_ubatch=lane.n_ubatch, swa_full=swa_full)  # fmt: skip
    return {
        "n_ctx": kv.cells * kv.streams,
        "n_ctx_seq": kv.ctx_per_slot,
        "kv": [{"swa": c.swa, "cells": c.cells, "layers": c.layers, "seqs": f"{lane.parallel:2d}/{kv.streams} seqs",
                "k_mib": c.k_bytes / MIB, "v_mib": c.v_bytes / MIB} for c in kv_caches(kv)],
        "compute_mib": lane_memory(facts, lane).devices[0].compute_bytes / MIB,
    }


def _fail_load(model_path: str, *lines: str) -> None:
    for line in lines:
        log("E", line)
    log("E", f"srv    load_model: failed to load model, '{model_path}'")
    log("E", "main: exiting due to model loading error")
    die(1)


def _on_signal(signum, frame) -> None:
    log("I", "srv    operator(): operator(): cleaning up before exit...")
    die(0)


def _ensure_deps() -> None:
    """Run under the repo's venv when started by a python3 that lacks msgspec/gguf (same pid)."""
    try:
        import gguf  # noqa: F401
        import msgspec  # noqa: F401
    except ImportError:
        venv = Path(_REPO) / ".venv" / "bin" / "python"
        if venv.exists() and os.path.abspath(sys.executable) != str(venv) and not os.environ.get("_FAKE_LLAMA_REEXEC"):
            os.environ["_FAKE_LLAMA_REEXEC"] = "1"
            os.execv(str(venv), [str(venv), os.path.abspath(__file__), *sys.argv[1:]])
        raise


def main(argv: list[str]) -> None:
    params = parse_args(argv)
    if params.get("help"):
        sys.stdout.write(help_text())
        sys.stdout.flush()
        die(0)

    _ensure_deps()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    v4 = params["verbosity"] >= 4
    explicit_np = params.get("parallel_set", False) or "LLAMA_ARG_N_PARALLEL" in os.environ
    if OLD:
        n_slots = params["parallel"] if params["parallel"] is not None else 1
        kv_unified = False
    elif not explicit_np or params["parallel"] is None or params["parallel"] < 0:
        n_slots, kv_unified = 4, True
        log("I", "main: n_parallel is set to auto, using n_parallel = 4 and kv_unified = true")
    else:
        n_slots, kv_unified = params["parallel"], bool(params["kv_unified"])
    if n_slots < 1:
        n_slots = 1

    log("I", f"build: {BUILD} ({COMMIT}) with cc (GCC) 13.2.0 for x86_64-linux-gnu")
    n_threads = params["threads"] if (params.get("threads") or 0) > 0 else os.cpu_count() or 1
    n_batch = params["threads_batch"] if (params.get("threads_batch") or 0) > 0 else n_threads
    log("I", f"system info: n_threads = {n_threads}, n_threads_batch = {n_batch}, total_threads = {os.cpu_count() or 1}")

    keys = [k for k in (params.get("api_key") or "").split(",") if k]
    if params.get("api_key_file"):
        try:
            with open(params["api_key_file"]) as f:
                keys += [line.strip() for line in f if line.strip()]
        except OSError:
            raw(f"error: failed to open file '{params['api_key_file']}'")
            die(1)
    STATE.api_keys = frozenset(keys)

    host, port = params["host"], params["port"]
    log("I", "main: binding port with default address family")
    try:
        cls = Server6 if ":" in host else Server
        httpd = cls((host, port), Handler)
    except OSError:
        log("E", f"{'main' if OLD else 'start'}: couldn't bind HTTP server socket, hostname: {host}, port: {port}")
        log("E", "main: exiting due to HTTP server error")
        die(1)
    port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    log("I", f"main: HTTP server is listening, hostname: {host}, port: {port}, http threads: {n_slots + 3}")
    log("I", "main: loading model")

    model_path = params["model"] or ""
    log("I", f"srv    load_model: loading model '{model_path}'")
    try:
        facts = model_facts(model_path)
    except Exception as exc:
        _fail_load(
            model_path,
            f"llama_model_load: error loading model: llama_model_loader: failed to load model from "
            f"{model_path}: {exc}",
            "llama_model_load_from_file_impl: failed to load model",
            f"common_init_from_params: failed to load model '{model_path}'",
        )
    STATE.params = params
    STATE.model_path = model_path
    STATE.alias = params["alias"] or model_path
    STATE.n_ctx_train = facts["n_ctx_train"]
    STATE.n_vocab = facts["n_vocab"]
    STATE.n_embd = facts["n_embd"]
    STATE.size = facts["weight_bytes"]
    STATE.n_params = facts["n_params"]
    if v4:
        log("I", f"llama_model_loader: loaded meta data from {model_path} (version GGUF V3 (latest))")
        log("I", f"print_info: arch             = {facts['architecture']}")
        log("I", f"print_info: n_ctx_train      = {facts['n_ctx_train']}")
        log("I", f"print_info: n_embd           = {facts['n_embd']}")
        log("I", f"print_info: n_layer          = {facts['n_layer']}")
        log("I", f"print_info: n_head           = {facts['n_head']}")
        log("I", f"print_info: n_head_kv        = {facts['n_head_kv']}")
        if facts["n_swa"]:
            log("I", f"print_info: n_swa            = {facts['n_swa']}")
        log("I", f"load_tensors: {'CPU_Mapped':>12} model buffer size = {facts['weight_bytes'] / MIB:8.2f} MiB")

    delay = float(os.environ.get("FAKE_LLAMA_LOAD_SECONDS", "0.3") or 0)
    if delay > 0:
        time.sleep(delay)

    # --- context creation
    ctx = params["ctx"] if params["ctx"] > 0 else facts["n_ctx_train"]
    type_k, type_v = params["cache_type_k"], params["cache_type_v"]
    fa = params["flash_attn"]
    if type_v in QUANTIZED and fa != "on":
        if OLD:
            _fail_load(model_path, "llama_init_from_model: V cache quantization requires flash_attn",
                       f"common_init_from_params: failed to create context with model '{model_path}'")
        if fa == "off":
            _fail_load(model_path, "llama_init_from_model: quantized V cache requires flash_attn to be enabled",
                       f"common_init_from_params: failed to create context with model '{model_path}'")
        log("W", "llama_init_from_model: enabling flash_attn since it is required for quantized V cache")
        fa = "on"
    if fa == "auto":
        fa = "on"  # the CPU backend supports flash attention: auto resolves to enabled
        if v4:
            log("I", "llama_context: flash_attn = auto -> enabled")
    for name, t, hd in (("K", type_k, facts["head_dim_k"]), ("V", type_v, facts["head_dim_v"])):
        if t in QUANTIZED and hd % 32:
            _fail_load(model_path, f"llama_init_from_model: {name} cache type {t} with block size 32 does not "
                       f"divide n_embd_head_{name.lower()}={hd}",
                       f"common_init_from_params: failed to create context with model '{model_path}'")

    shape = figures_key(facts, ctx=pad(ctx), slots=n_slots, kv_unified=kv_unified or OLD, type_k=type_k,
                        type_v=type_v, flash_attn=fa, n_ubatch=params["n_ubatch"],
                        swa_full=bool(params["swa_full"]) or OLD)
    fig = recorded_figures(shape, argv, model_path)
    if fig is None:
        try:  # recording mode only: serve the model's figures until the real binary's are recorded
            fig = _computed_figures(model_path, ctx=pad(ctx), parallel=n_slots, kv_unified=kv_unified or OLD,
                                    type_k=type_k, type_v=type_v, flash_attn=fa == "on", n_ubatch=params["n_ubatch"],
                                    swa_full=bool(params["swa_full"]) or OLD)  # fmt: skip
        except ValueError as exc:  # shared.memory's MemoryModelError
            _fail_load(model_path, f"llama_init_from_model: failed to initialize the context: {exc}",
                       f"common_init_from_params: failed to create context with model '{model_path}'")
    if fig.get("error"):  # the real binary refused this shape: say what it said
        _fail_load(model_path, *fig["error"])
    n_ctx = fig["n_ctx"]
    # Old builds split the one shared cache's context evenly between the slots.
    n_ctx_seq = n_ctx // n_slots if OLD else fig["n_ctx_seq"]
    kv_total = round(sum(g["k_mib"] + g["v_mib"] for g in fig["kv"]) * MIB)
    STATE.n_ctx = n_ctx
    STATE.n_ctx_slot = n_ctx_seq
    STATE.n_slots = n_slots
    if v4:
        log("I", "llama_context: constructing llama_context")
        log("I", f"llama_context: n_seq_max     = {n_slots}")
        log("I", f"llama_context: n_ctx         = {n_ctx}")
        if not OLD:
            log("I", f"llama_context: n_ctx_seq     = {fig['n_ctx_seq']}")
        log("I", f"llama_context: n_batch       = {params['n_batch']}")
        log("I", f"llama_context: n_ubatch      = {params['n_ubatch']}")
        log("I", f"llama_context: flash_attn    = {'enabled' if fa == 'on' else 'disabled'}")
        if not OLD:
            log("I", f"llama_context: kv_unified    = {'true' if kv_unified else 'false'}")

    oom_above = os.environ.get("FAKE_LLAMA_OOM_ABOVE_CTX")
    if oom_above and ctx > int(oom_above):
        _fail_load(model_path,
                   f"ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size {kv_total}",
                   "llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache",
                   f"common_init_from_params: failed to create context with model '{model_path}'")

    if OLD:
        # One cache for every slot and every layer, printed at the default verbosity.
        k = sum(g["k_mib"] for g in fig["kv"])
        v = sum(g["v_mib"] for g in fig["kv"])
        log("I", f"llama_init_from_model: KV self size  = {k + v:7.2f} MiB, "
            f"K ({type_k}): {k:7.2f} MiB, V ({type_v}): {v:7.2f} MiB")
    elif v4:
        swa = len(fig["kv"]) > 1
        scale = float(os.environ.get("FAKE_LLAMA_KV_SCALE", "1") or 1)
        for g in fig["kv"]:
            k, v = g["k_mib"] * scale, g["v_mib"] * scale
            if swa:
                label = "    SWA" if g["swa"] else "non-SWA"
                log("I", f"llama_kv_cache_iswa: creating {label} KV cache, size = {g['cells']} cells")
            log("I", f"llama_kv_cache: {'CPU':>10} KV buffer size = {k + v:8.2f} MiB")
            log("I", f"llama_kv_cache: size = {k + v:7.2f} MiB ({g['cells']:6d} cells, {g['layers']:3d} layers, "
                f"{g['seqs']}), K ({type_k}): {k:7.2f} MiB, V ({type_v}): {v:7.2f} MiB")
    if os.environ.get("FAKE_LLAMA_ALLOC", "") not in ("", "0"):
        total = kv_total
        if total > 0:
            buf = bytearray(total)
            buf[::4096] = b"\x01" * len(range(0, total, 4096))  # touch every page
            STATE.keep.append(buf)
    if v4:
        log("I", f"llama_context: {'CPU':>10} compute buffer size = {fig['compute_mib']:8.2f} MiB")

    log("I", f"srv    load_model: initializing, n_slots = {n_slots}, n_ctx_slot = {n_ctx_seq}, "
        f"kv_unified = '{'true' if kv_unified else 'false'}'")
    log("I", "main: model loaded")
    log("I", f"main: server is listening on http://{host}:{port} - starting the main loop")
    STATE.loading = False
    log("I", "srv  update_slots: all slots are idle")

    crash_after = os.environ.get("FAKE_LLAMA_CRASH_AFTER")
    if crash_after:
        time.sleep(float(crash_after))
        if os.environ.get("FAKE_LLAMA_CRASH_SIGNAL", "") not in ("", "0"):
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGSEGV)
        raw("Segmentation fault (core dumped)")
        die(139)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
