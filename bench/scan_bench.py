"""Model scan time: the real Gemma 3 270M file (262k vocabulary), cold and cached.

cold:    shared.gguf_facts.read_model_facts (header scan, the file's real metadata)
gguf:    gguf.GGUFReader + the old field walk (what `lanes models` did before), for the ratio
cached:  scan_models through a FactsCache file, as a restarted agent does (no file is read)

    .venv/bin/python bench/scan_bench.py [--repeats 5] [--model PATH]
Medians of the repeats; the page cache is warm after the first run (the file is read, not parsed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.gguf_facts import FactsCache, read_model_facts, scan_models  # noqa: E402


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        else:
            from lanes.demo_model import ensure_demo_model

            model = ensure_demo_model(Path(tmp) / "models")
        folder = model.parent
        cold = timed(lambda: read_model_facts(model), args.repeats)

        def old_reader():
            from gguf import GGUFReader

            reader = GGUFReader(model, "r")
            for field in reader.fields.values():
                field.contents()

        old = timed(old_reader, max(1, args.repeats // 2))
        cache_file = Path(tmp) / "facts.json"
        scan_models([folder], FactsCache(cache_file))
        cached = timed(lambda: scan_models([folder], FactsCache(cache_file)), args.repeats)
    print(f"model {model.name} ({model.stat().st_size / 2**20:.0f} MiB, {read_model_facts(model).n_vocab} tokens)")
    print(f"header scan (cold parse): {cold * 1000:.1f} ms   gguf.GGUFReader: {old * 1000:.0f} ms   "
          f"ratio {old / cold:.0f}x   cached (agent restart): {cached * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
