"""shared.llama.logs: llama-server's own lines (as it prints them at -lv 4) read into facts."""

from __future__ import annotations

import pytest

from shared.llama.logs import (
    classify_failure,
    device_name,
    devices_from_lines,
    is_buffer_line,
    is_kv_size_line,
    is_loaded_line,
    kv_mib_from_log,
    parse_buffers,
)

# A CPU lane of a current build (b11434), verbosity 4, time prefixes as printed.
CPU_LANE = [
    "0.00.012.001 I build: 11434 (8c2b6e4) with cc (GCC) 12.2.0 for x86_64-linux-gnu",
    "0.00.153.786 I load_tensors:   CPU_Mapped model buffer size =     5.01 MiB",
    "0.00.199.700 I llama_context:        CPU  output buffer size =     0.49 MiB",
    "0.00.199.720 I llama_kv_cache:        CPU KV buffer size =    16.00 MiB",
    "0.00.199.734 I llama_kv_cache: size =   16.00 MiB (  4096 cells,   2 layers,  1/1 seqs), K (f16):    8.00 MiB, V (f16):    8.00 MiB",
    "0.00.201.010 I sched_reserve:        CPU compute buffer size =     8.52 MiB",
    "0.00.201.500 I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 4096, kv_unified = 'false'",
    "0.00.201.900 I main: model loaded",
    "0.00.202.000 I main: server is listening on http://127.0.0.1:8080",
]


def test_kv_lines_are_summed_across_swa_and_full_caches():
    lines = [
        "0.00.199.734 I llama_kv_cache: size =    2.00 MiB (  2048 cells,   1 layers,  2/2 seqs), K (f16):    1.00 MiB",
        "0.00.199.800 I llama_kv_cache: size =    5.00 MiB (  1024 cells,   5 layers,  2/2 seqs), K (f16):    2.50 MiB",
        "llama_init_from_model: KV self size  =    6.38 MiB, K (q8_0):    3.19 MiB, V (q8_0):    3.19 MiB",
    ]
    assert kv_mib_from_log(lines[:2]) == pytest.approx(7.0)
    assert kv_mib_from_log(lines[2:]) == pytest.approx(6.38)
    assert kv_mib_from_log(["nothing here"]) is None
    assert kv_mib_from_log(["llama_kv_cache_unified: size =   4.00 MiB (  256 cells)"]) == pytest.approx(4.0)  # older prefix


def test_the_lines_a_lane_keeps_are_the_ones_read():
    kept_kv = [line for line in CPU_LANE if is_kv_size_line(line)]
    kept_buffers = [line for line in CPU_LANE if is_buffer_line(line)]
    assert kv_mib_from_log(kept_kv) == kv_mib_from_log(CPU_LANE) == pytest.approx(16.0)
    assert parse_buffers(kept_buffers) == parse_buffers(CPU_LANE)
    assert len(kept_kv) == 1 and len(kept_buffers) == 4
    assert is_buffer_line("load_tensors: offloaded 9/9 layers to GPU")
    assert [line for line in CPU_LANE if is_loaded_line(line)] == CPU_LANE[-3:]


def test_cpu_buffers_per_kind():
    printed = parse_buffers(CPU_LANE)
    assert printed.mib == {"CPU": {"model": 5.01, "output": 0.49, "KV": 16.0, "compute": 8.52}}
    (cpu,) = devices_from_lines(CPU_LANE)
    assert cpu.device == "CPU" and cpu.kv_bytes == 16 * 1024 * 1024 and cpu.model_bytes == round(5.01 * 1024 * 1024)


@pytest.mark.parametrize(
    "buffer, device",
    [("CPU", "CPU"), ("CPU_Mapped", "CPU"), ("CPU_REPACK", "CPU"), ("CUDA_Host", "CPU"), ("CUDA0", "GPU0"),
     ("CUDA1", "GPU1"), ("RPC0[127.0.0.1:50052]", "GPU0"), ("Vulkan2", "GPU2"), ("MTL0", "GPU0"),
     ("MTL0_Mapped", "GPU0")],
)  # fmt: skip
def test_buffer_names_map_to_lane_devices(buffer, device):
    assert device_name(buffer) == device


def test_devices_follow_the_order_llama_server_uses_them():
    lines = [
        "llama_prepare_model_devices: using device CUDA1 (NVIDIA L4)",
        "llama_prepare_model_devices: using device RPC0 (127.0.0.1:50053)",
        "load_tensors: offloaded 9/9 layers to GPU",
        "load_tensors:   CPU_Mapped model buffer size =    10.00 MiB",
        "load_tensors:        CUDA1 model buffer size =    20.00 MiB",
        "load_tensors: RPC0[127.0.0.1:50053] model buffer size =    17.91 MiB",
        "llama_kv_cache:      CUDA1 KV buffer size =     8.00 MiB",
        "llama_kv_cache: RPC0[127.0.0.1:50053] KV buffer size =     4.00 MiB",
    ]
    printed = parse_buffers(lines)
    assert parse_buffers([line for line in lines if is_buffer_line(line)]) == printed  # what the agent keeps
    assert printed.offloaded == (9, 9)
    assert printed.devices() == ["CPU", "GPU0", "GPU1"]  # CUDA1 is the lane's first device
    assert printed.get("GPU0", "model") == 20.0 and printed.get("GPU1", "model") == 17.91
    assert printed.get("GPU1", "KV") == 4.0 and printed.get("CPU", "KV") == 0.0


@pytest.mark.parametrize(
    "line, kind",
    [
        ("E ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 536870912", "oom"),
        ("libgomp: Thread creation failed: Resource temporarily unavailable", "oom"),
        ('error while handling argument "--cache-type-k": Unsupported cache type: q6_K', "unsupported"),
        ("E llama_init_from_model: quantized V cache requires flash_attn to be enabled", "unsupported"),
        ("error: unknown value for --flash-attn: '--port'", "unsupported"),
        ("invalid argument: --no-mmap", "unsupported"),
        ("E srv    start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080", "port_busy"),
        ("E llama_model_load: error loading model: missing tensor 'output_norm.weight'", "other"),
    ],
)
def test_failures_are_classified_with_llama_servers_own_line(line, kind):
    got_kind, got_line = classify_failure(["0.00.001 I build: 1", line, "E main: exiting due to model loading error"])
    assert got_kind == kind
    assert got_line == line.strip()


def test_a_failure_without_a_known_line_names_the_first_error_or_the_last_line():
    assert classify_failure(["I build: 1", "Segmentation fault"]) == ("other", "Segmentation fault")
    assert classify_failure([]) == ("other", "exited without output")
