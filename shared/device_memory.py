"""Moved to shared.memory (issue 15). Only for launcher_agent/hardware.py's import until the merge
changes it to `from shared.memory import AVX2_REPACK, AVX512_REPACK, NEON_DOTPROD_REPACK, NEON_I8MM_REPACK`;
then delete this file."""

from shared.memory.cpu_repack import AVX2_REPACK, AVX512_REPACK, NEON_DOTPROD_REPACK, NEON_I8MM_REPACK

__all__ = ["AVX2_REPACK", "AVX512_REPACK", "NEON_DOTPROD_REPACK", "NEON_I8MM_REPACK"]
