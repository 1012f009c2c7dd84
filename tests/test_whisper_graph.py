"""Audio projectors on Whisper's encoder (qwen2a, ultravox, voxtral, musicflamingo, meralion, glma): the compute
buffer shared/memory/whisper_graph.py predicts by replaying ggml-alloc on clip's graph, against the real b11434
binaries: tests/audio_figures.json (for each shape the CPU build's printed MiB with --no-mmproj-offload and the RPC
server's exact bytes with the projector offloaded, files from tests/tinyaudio.py) and the qwen2a figures of
tests/llama_figures.json (printed MiB).

To record the figures again (every SHAPES row; --missing: only those not recorded yet):

  PYTHONPATH=tests:. .venv/bin/python tests/test_whisper_graph.py [--missing]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shared.memory.graph_alloc import replay  # noqa: E402
from shared.memory.whisper_graph import _bytes, build_graph, ggml_pad, whisper_compute_bytes  # noqa: E402

MIB = 2**20
FIGURES = Path(__file__).with_name("audio_figures.json")
TABLE = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
QWEN2A_CPU = {k: v for k, v in json.loads((Path(__file__).parent / "llama_figures.json").read_text()).items()
              if "type=qwen2a" in k}  # fmt: skip

# (type, n_embd, n_ff, n_head, n_layer, n_mel, text_embd, stack_factor, hidden, flash_attn); stack and hidden 0
# where the type reads none. The real models' encoders are Whisper-large's (1280 wide, 5120 FFN, 20 heads, 128
# mel bins), here with one block of their 32.
SHAPES = [
    ("qwen2a", 1280, 5120, 20, 1, 128, 4096, 0, 0, "on"),  # Qwen2-Audio-7B
    ("qwen2a", 1280, 5120, 20, 1, 128, 4096, 0, 0, "off"),
    ("qwen2a", 128, 256, 4, 2, 128, 256, 0, 0, "on"),
    ("qwen2a", 128, 256, 4, 2, 128, 256, 0, 0, "off"),
    ("qwen2a", 256, 1024, 8, 2, 80, 2048, 0, 0, "off"),
    ("qwen2a", 64, 128, 2, 1, 16, 8192, 0, 0, "on"),
    ("ultravox", 1280, 5120, 20, 1, 128, 2048, 8, 4096, "on"),  # Ultravox 0.5 on Llama 3.2 1B
    ("ultravox", 1280, 5120, 20, 1, 128, 2048, 8, 4096, "off"),
    ("ultravox", 1280, 5120, 20, 2, 128, 4096, 8, 4096, "on"),  # ... on Llama 3.1 8B
    ("ultravox", 128, 256, 4, 2, 128, 256, 8, 512, "on"),
    ("ultravox", 128, 256, 4, 2, 128, 256, 8, 512, "off"),
    ("ultravox", 64, 128, 2, 1, 16, 8192, 8, 16384, "on"),
    ("ultravox", 256, 1024, 4, 2, 80, 2048, 7, 4096, "off"),
    ("ultravox", 96, 192, 3, 1, 32, 4096, 5, 12288, "on"),
    ("ultravox", 64, 256, 1, 2, 32, 2048, 3, 16384, "off"),  # the head's peak above the scores' freed blocks
    ("voxtral", 1280, 5120, 20, 1, 128, 3072, 4, 3072, "on"),  # Voxtral Mini (Ministral 3B)
    ("voxtral", 1280, 5120, 20, 1, 128, 3072, 4, 3072, "off"),
    ("voxtral", 1280, 5120, 20, 2, 128, 5120, 4, 5120, "on"),  # Voxtral Small (Mistral Small 24B)
    ("voxtral", 128, 256, 4, 2, 128, 256, 4, 256, "on"),
    ("voxtral", 128, 256, 4, 2, 128, 256, 4, 256, "off"),
    ("voxtral", 64, 128, 2, 1, 16, 8192, 4, 8192, "on"),
    ("voxtral", 256, 1024, 8, 3, 80, 2048, 4, 2048, "off"),
    ("voxtral", 96, 192, 3, 1, 32, 4096, 3, 16384, "on"),
    ("voxtral", 64, 256, 2, 2, 32, 2048, 6, 16384, "off"),
    ("musicflamingo", 1280, 5120, 20, 1, 128, 3584, 0, 3584, "on"),  # Audio Flamingo 3 (Qwen2.5-7B)
    ("musicflamingo", 1280, 5120, 20, 1, 128, 3584, 0, 3584, "off"),
    ("musicflamingo", 128, 256, 4, 2, 128, 256, 0, 256, "on"),
    ("musicflamingo", 128, 256, 4, 2, 128, 256, 0, 512, "off"),
    ("musicflamingo", 64, 128, 2, 1, 16, 8192, 0, 8192, "on"),
    ("musicflamingo", 256, 1024, 8, 2, 80, 2048, 0, 4096, "off"),
    ("meralion", 1280, 5120, 20, 1, 128, 2304, 15, 6400, "on"),  # MERaLiON 2 3B (Gemma 2 2B)
    ("meralion", 1280, 5120, 20, 1, 128, 2304, 15, 6400, "off"),
    ("meralion", 128, 256, 4, 2, 128, 256, 15, 512, "on"),
    ("meralion", 128, 256, 4, 2, 128, 256, 15, 512, "off"),
    ("meralion", 64, 128, 2, 1, 16, 8192, 15, 8192, "on"),
    ("meralion", 256, 1024, 8, 2, 80, 2048, 7, 4096, "off"),
    ("glma", 1280, 5120, 20, 1, 128, 2048, 4, 4096, "on"),  # GLM-ASR-Nano's widths
    ("glma", 1280, 5120, 20, 1, 128, 2048, 4, 4096, "off"),
    ("glma", 128, 256, 4, 2, 128, 256, 4, 512, "on"),
    ("glma", 128, 256, 4, 2, 128, 256, 4, 512, "off"),
    ("glma", 64, 128, 2, 1, 16, 8192, 4, 8192, "on"),
    ("glma", 256, 1024, 8, 2, 80, 2048, 7, 4096, "off"),
]


def shape_key(proj_type, n_embd, n_ff, n_head, n_layer, n_mel, text_embd, stack, hidden, fa) -> str:
    return (f"audio|type={proj_type}|n_embd={n_embd}|n_ff={n_ff}|n_head={n_head}|n_layer={n_layer}|n_mel={n_mel}|"
            f"text_embd={text_embd}|stack={stack}|hidden={hidden}|flash_attn={fa}")  # fmt: skip


def _args(key: str) -> dict:
    p = dict(x.split("=") for x in key.split("|")[1:])
    return dict(proj_type=p["type"], n_embd=int(p["n_embd"]), n_ff=int(p["n_ff"]), n_head=int(p["n_head"]),
                n_layer=int(p["n_layer"]), n_mel=int(p.get("n_mel", p.get("image", 0))), text_embd=int(p["text_embd"]),
                stack_factor=int(p.get("stack", 0)), proj_hidden=int(p.get("hidden", 0)),
                flash_attn=p["flash_attn"] == "on")  # fmt: skip


def _mib(n: int) -> float:
    return round(n / MIB, 2)


# --- against the recorded figures ---


def test_every_type_has_six_shapes_with_both_buffers():
    by_type: dict[str, int] = {}
    for key, fig in TABLE.items():
        assert "cpu_mib" in fig and "rpc_bytes" in fig, key
        by_type[_args(key)["proj_type"]] = by_type.get(_args(key)["proj_type"], 0) + 1
    assert {t for t, n in by_type.items() if n >= 6} >= {"qwen2a", "ultravox", "voxtral"}


@pytest.mark.parametrize("key", sorted(TABLE))
def test_device_buffer_is_exact(key):
    """--mmproj-offload on an RPC device: the device's compute buffer, to the byte, and its printed MiB."""
    fig, got = TABLE[key], whisper_compute_bytes(**_args(key))
    assert got == fig["rpc_bytes"]
    assert _mib(got) == fig["rpc_mib"]


@pytest.mark.parametrize("key", sorted(TABLE))
def test_cpu_buffer_prints_as_recorded(key):
    """--no-mmproj-offload: the CPU's buffer (the same graph with the mel frames a leaf), as printed."""
    fig, args = TABLE[key], _args(key)
    assert _mib(whisper_compute_bytes(**args)) == fig["cpu_mib"]
    assert fig["clip_flash_attn"] == ("enabled" if args["flash_attn"] else "disabled")


@pytest.mark.parametrize("key", sorted(TABLE))
def test_graph_has_clips_node_count(key):
    """clip prints the graph's node count (`graph splits = 1, nodes = N`): the rebuilt graph has as many."""
    args = _args(key)
    graph = build_graph(**args)
    assert len(graph.nodes) == TABLE[key]["nodes"]
    assert TABLE[key]["rpc_splits"] == 1


@pytest.mark.parametrize("key", sorted(QWEN2A_CPU))
def test_qwen2a_figures_of_the_projector_table(key):
    """tests/llama_figures.json's Qwen2-Audio shapes (tinyprojectors' file), printed MiB on the CPU."""
    fig = QWEN2A_CPU[key]
    assert _mib(whisper_compute_bytes(**_args(key))) == fig["compute_mib"]["CPU"]


@pytest.mark.parametrize("fa", [True, False])
@pytest.mark.parametrize("proj_type", ["qwen2a", "ultravox", "voxtral"])
def test_cpu_and_device_graphs_need_the_same(proj_type, fa):
    args = dict(proj_type=proj_type, n_embd=128, n_ff=256, n_head=4, n_layer=2, n_mel=80, text_embd=512,
                stack_factor=8 if proj_type == "ultravox" else 4, proj_hidden=1024, flash_attn=fa)  # fmt: skip
    sizes = {replay(build_graph(**args), offload_inputs=dev).size for dev in (False, True)}
    assert sizes == {whisper_compute_bytes(**args)}


def test_the_head_can_be_the_peak():
    """Past a narrow encoder a wide head sets the buffer: ultravox's mm.a.mlp.1 output and its SwiGLU over 188
    stacked rows (1,500 positions / 8, padded up: the stride 64 x 8 is a power of 2, so GGML_PAD rounds right)."""
    args = dict(proj_type="ultravox", n_embd=64, n_ff=128, n_head=2, n_layer=1, n_mel=16, text_embd=8192,
                stack_factor=8, proj_hidden=16384, flash_attn=True)  # fmt: skip
    rep = replay(build_graph(**args))
    assert [(label, size) for label, _, size in rep.live] == [("MUL_MAT", 188 * 16384 * 4), ("GLU", 188 * 8192 * 4)]
    assert rep.size == whisper_compute_bytes(**args) == rep.live[-1][1] + rep.live[-1][2]


def test_ggml_pad_is_a_bit_mask():
    """build_stack pads with GGML_PAD, exact only for power-of-2 strides: Ultravox's 1280 x 8 leaves 187 rows of
    1,500 positions (not 188), with a pad all the same; 96 x 5 pads 300 whole rows (measured: 2 more nodes)."""
    assert ggml_pad(1500 * 1280, 1280 * 8) // (1280 * 8) == 187 and ggml_pad(1500 * 1280, 1280 * 8) > 1500 * 1280
    assert ggml_pad(1500 * 64, 64 * 8) // (64 * 8) == 188
    assert ggml_pad(1500 * 96, 96 * 5) > 1500 * 96 and ggml_pad(1500 * 96, 96 * 5) // (96 * 5) == 300


def test_bad_arguments_are_refused():
    args = dict(n_embd=128, n_ff=256, n_head=4, n_layer=1, n_mel=80, text_embd=256, flash_attn=True)
    with pytest.raises(ValueError):
        whisper_compute_bytes(proj_type="gemma3", **args)
    with pytest.raises(ValueError):
        whisper_compute_bytes(proj_type="voxtral", proj_hidden=256, **args)  # no stack factor
    with pytest.raises(ValueError):
        whisper_compute_bytes(proj_type="ultravox", stack_factor=8, proj_hidden=255, **args)
    with pytest.raises(ValueError):
        whisper_compute_bytes(proj_type="qwen2a", **{**args, "n_head": 3})
    # facts a type does not read are ignored (and share the cache)
    assert whisper_compute_bytes(proj_type="qwen2a", stack_factor=9, proj_hidden=7, **args) == whisper_compute_bytes(
        proj_type="qwen2a", **args)


def test_a_call_is_fast_and_cached():
    args = dict(proj_type="voxtral", n_embd=1280, n_ff=5120, n_head=20, n_layer=32, n_mel=128, text_embd=3072,
                stack_factor=4, proj_hidden=3072, flash_attn=False)  # fmt: skip
    _bytes.cache_clear()
    start = time.perf_counter()
    first = whisper_compute_bytes(**args)
    built = time.perf_counter() - start
    start = time.perf_counter()
    assert whisper_compute_bytes(**args) == first
    assert time.perf_counter() - start < built / 10 and built < 1.0


# --- the real binaries ---

_COMPUTE = re.compile(r"reserve_compute_meta: +(\S+) compute buffer size = +([\d.]+) MiB")
_FA = re.compile(r"warmup: flash attention is (enabled|disabled)")
_SPLITS = re.compile(r"reserve_compute_meta: graph splits = (\d+), nodes = (\d+)")
_ALLOC = re.compile(r"\[alloc_buffer\] device: 0, size: (\d+) ->")


def measure_rpc(bin_dir: Path, model: Path, mmproj: Path, flash_attn: str, timeout: float = 180.0) -> dict:
    """The projector offloaded to an RPC device (GGML_RPC_DEBUG logs each buffer it allocates): clip's printed lines
    and the device's last buffer once llama-server listens, its compute buffer (clip reserves it last). No request:
    every chunk is the warm-up's 3,000 frames."""
    from record_llama_figures import stop
    from record_projector_figures import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        rpc_log, server_log, port = Path(tmp) / "rpc.log", Path(tmp) / "server.log", _free_port()
        with rpc_log.open("w") as out:
            rpc = subprocess.Popen([str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                   stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, GGML_RPC_DEBUG="1"))  # fmt: skip
        try:
            time.sleep(1.0)
            argv = [str(bin_dir / "llama-server"), "-m", str(model), "--mmproj", str(mmproj), "--rpc",
                    f"127.0.0.1:{port}", "-ngl", "0", "-c", "512", "-fit", "off", "--flash-attn", flash_attn,
                    "--verbosity", "4", "--mmproj-offload", "--host", "127.0.0.1", "--port", str(_free_port())]  # fmt: skip
            with server_log.open("w") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + timeout
                while "listening on http" not in server_log.read_text() and time.monotonic() < deadline:
                    if proc.poll() is not None:
                        break
                    time.sleep(0.1)
                sizes = [int(s) for s in _ALLOC.findall(rpc_log.read_text())]
            finally:
                stop(proc)
        finally:
            stop(rpc)
        text = server_log.read_text()
    computes = {m.group(1).split("[")[0]: float(m.group(2)) for m in _COMPUTE.finditer(text)}
    splits = _SPLITS.findall(text)
    if "RPC0" not in computes or not sizes or not splits:
        return {"error": [ln for ln in text.splitlines() if "error" in ln.lower() or "fail" in ln.lower()][-3:]}
    return {"rpc_mib": computes["RPC0"], "rpc_bytes": sizes[-1], "rpc_splits": int(splits[-1][0]),
            "nodes": int(splits[-1][1]), "clip_flash_attn": (m.group(1) if (m := _FA.search(text)) else "")}  # fmt: skip


def measure_shape(folder: Path, shape: tuple, binary: str, bin_dir: Path) -> dict:
    from record_projector_figures import measure
    from tinyaudio import audio_pair

    proj_type, n_embd, n_ff, n_head, n_layer, n_mel, text, stack, hidden, fa = shape
    head = ({"stack_factor": stack} if stack else {}) | ({"hidden": hidden} if hidden else {})
    model, mmproj = audio_pair(folder, proj_type, text_embd=text, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                               n_layer=n_layer, n_mel=n_mel, **head)  # fmt: skip
    try:
        cpu = measure(binary, model, mmproj, fa)
        if "error" in cpu:
            return cpu
        dev = measure_rpc(bin_dir, model, mmproj, fa)
        if "error" in dev:
            return dev
    finally:
        mmproj.unlink()
    if dev["clip_flash_attn"] != cpu["clip_flash_attn"]:
        return {"error": [f"flash attention {cpu['clip_flash_attn']} on the CPU, {dev['clip_flash_attn']} on RPC"]}
    return {"cpu_mib": cpu["compute_mib"]["CPU"], **dev}


@pytest.mark.slow
def test_real_binary_matches_a_new_shape(tmp_path, llama_server, rpc_bin):
    """A shape in no table (odd widths, 3 blocks, a stack that pads, FA off) through both real binaries."""
    shape = ("ultravox", 160, 480, 5, 3, 64, 1536, 6, 2560, "off")
    fig = measure_shape(tmp_path, shape, llama_server, rpc_bin)
    assert "error" not in fig, fig
    got = whisper_compute_bytes(**_args(shape_key(*shape)))
    assert got == fig["rpc_bytes"] and _mib(got) == fig["rpc_mib"] == fig["cpu_mib"]


def main() -> int:
    from lanes.install_rpc import rpc_bin_dir
    from launcher_agent.probe import find_llama_server

    binary, bin_dir = find_llama_server(), rpc_bin_dir()
    if binary is None or bin_dir is None:
        print("no llama-server or RPC build: run `lanes install-llama --rpc`", file=sys.stderr)
        return 2
    table = dict(TABLE)
    missing = "--missing" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            key = shape_key(*shape)
            if missing and key in table:
                continue
            fig = measure_shape(Path(tmp), shape, binary, bin_dir)
            args = _args(key)
            want = whisper_compute_bytes(**args)
            print(key, fig.get("error") or (fig["cpu_mib"], fig["rpc_bytes"], fig["nodes"], "predicted", want,
                                            len(build_graph(**args).nodes)), flush=True)  # fmt: skip
            if "error" not in fig:
                table[key] = fig
                FIGURES.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
