"""lanes' own version, from the installed package's metadata (pyproject.toml is the one source)."""

from __future__ import annotations

from importlib import metadata

try:
    VERSION = metadata.version("lanes")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0.0.0+source"
