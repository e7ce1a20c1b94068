"""The native batch-invariant linear kernel: compiled once on first use, optional.

``csrc/linear_rows.cpp`` computes ``x @ w.T`` so that a row's bits never depend on how many rows
share the call, at GEMV speed for one row (see the file's header). It is built with the system
C++ compiler through ``torch.utils.cpp_extension`` into ``$SPECDECODE_HOME/kernels`` (or
``$SPECDECODE_KERNELS``) the first time a model loads (about 30 s), then loaded from there.
Where it cannot be built or run (no compiler, no AVX2), ``load()`` returns None once with a
warning and the decoder uses its portable torch path, which is exact too but slower.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).parent / "csrc" / "linear_rows.cpp"


def cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None when it is unavailable (reason printed once)."""
    if os.environ.get("SPECDECODE_NATIVE", "1") == "0":
        return None
    if not cpu_has_avx2_fma():
        return _unavailable("this CPU lacks AVX2/FMA")
    from torch.utils import cpp_extension

    from specdecode.models.catalog import specdecode_home

    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + str(flags).encode()).hexdigest()[:12]
    root = os.environ.get("SPECDECODE_KERNELS") or specdecode_home() / "kernels"
    build = Path(root) / digest
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"specdecode_linear_rows_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the portable path
        return _unavailable(f"building it failed ({str(exc).splitlines()[0][:200]})")


def _unavailable(reason: str) -> None:
    print(f"specdecode: native kernel unavailable, {reason}; using the slower portable path",
          file=sys.stderr)
    return None
