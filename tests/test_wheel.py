"""The built wheel installs alone: into a clean virtual environment, run from outside the source
tree, `lanes --version` and `lanes estimate` on the demo file work with nothing from the tree."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done


def test_wheel_installs_alone(tmp_path, gemma_model):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)], cwd=tmp_path)
    (wheel,) = wheels.glob("lanes-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    _run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], cwd=tmp_path)

    # No llama-server, no source tree on the path: only what the wheel installed.
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    where = _run([str(venv / "bin" / "python"), "-c", "import lanes, shared, gateway; print(lanes.__file__)"],
                 cwd=tmp_path, env=env)  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(venv)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _run([str(venv / "bin" / "lanes"), "--version"], cwd=tmp_path, env=env).stdout.strip() == f"lanes {version}"
    estimate = _run([str(venv / "bin" / "lanes"), "estimate", str(gemma_model), "--ctx", "4096", "--json"],
                    cwd=tmp_path, env=env)  # fmt: skip
    assert json.loads(estimate.stdout)["kv_bytes"] > 0
    # The dashboard's files ship in the package.
    static = _run([str(venv / "bin" / "python"), "-c",
                   "import gateway.dashboard, pathlib; print(sorted(p.name for p in (pathlib.Path(gateway.dashboard.__file__).parent / 'static').iterdir()))"],
                  cwd=tmp_path, env=env)  # fmt: skip
    assert static.stdout.strip() == str(sorted(p.name for p in (ROOT / "gateway" / "dashboard" / "static").iterdir()))
