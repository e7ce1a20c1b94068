"""Builds and loads the C++ kernels in ``csrc/``: their compiler flags, build folders and fallbacks.

``csrc/linear_rows.cpp``, the batch-invariant linear kernel (optional), computes ``x @ w.T`` so that
a row's bits never depend on how many rows share the call, at GEMV speed for one row (see the file's
header). It is built with the system C++ compiler through ``torch.utils.cpp_extension`` into
``$SPECDECODE_HOME/kernels`` (or ``$SPECDECODE_KERNELS``) the first time a model loads (about 30 s),
then loaded from there. It is built for AVX-512 where the CPU has it (``SPECDECODE_AVX512=0`` forces
the AVX2 build). Where it cannot be built or run (no compiler, no AVX2), ``load()`` returns None
once with a warning and the decoder uses its portable torch path, which is exact too but slower.
``csrc/linear_int4.cpp``, the int4 draft kernel, is built the same way on first use of an int4
draft: for AVX-512 VNNI where the CPU has it, else for AVX2 (``int4_flags()``). The GGUF kernel
(``csrc/linear_gguf.cpp``) has three builds with the same bits, portable, AVX2 and VNNI
(``gguf_isas()``); it uses the fastest the CPU runs unless ``SPECDECODE_GGUF_ISA`` names one. Builds
hold a ``flock`` on their folder, so a build killed midway never blocks the next.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from specdecode.errors import UnsupportedModelError
from specdecode.files import file_lock, specdecode_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "linear_rows.cpp"
INT4_SOURCE = Path(__file__).parent / "csrc" / "linear_int4.cpp"
GGUF_SOURCE = Path(__file__).parent / "csrc" / "linear_gguf.cpp"
ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "attention_rows.cpp"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


AVX512_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _flags_for(features: tuple[str, ...]) -> list[str]:
    """AVX2/FMA build flags, plus ``-m<feature>`` for each of ``features`` (``/proc/cpuinfo``
    names, which match GCC's but for an underscore) when the CPU lists them all and
    ``SPECDECODE_AVX512`` is not 0."""
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
    if os.environ.get("SPECDECODE_AVX512", "1") != "0" and set(features) <= _cpu_flags():
        flags += ["-m" + f.replace("_", "") for f in features]
    return flags


def compile_flags() -> list[str]:
    """Compiler flags for this CPU: AVX-512 (16-lane accumulators, twice the arithmetic per
    instruction, which multi-row verify steps need) when it has it, else AVX2/FMA. The lane count
    changes the kernel's bits between builds, never between the calls of one build."""
    return _flags_for(AVX512_FEATURES)


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None when it is unavailable (reason printed once)."""
    if os.environ.get("SPECDECODE_NATIVE", "1") == "0":
        return None
    if not cpu_has_avx2_fma():
        return _unavailable("this CPU lacks AVX2/FMA")
    return _build(SOURCE, "linear_rows", compile_flags(), _unavailable)


def int4_flags() -> list[str]:
    """Compiler flags of the int4 draft kernel: its AVX-512 VNNI build (one VPDPBUSD per group of
    64 inputs) where the CPU has it and ``SPECDECODE_AVX512`` is not 0, else its AVX2 build (two
    VPMADDUBSW and a VPMADDWD per group). Drafts may round either way; exactness never depends
    on them. F16C widens the fused forward's fp16 scales; floats are never contracted implicitly,
    so both builds round alike (see the kernel's header)."""
    return [*_flags_for((*AVX512_FEATURES, "avx512_vnni")), "-mf16c", "-ffp-contract=off"]


@functools.cache
def load_int4() -> ModuleType | None:
    """The int4 draft kernel (``csrc/linear_int4.cpp``), or None where the CPU lacks AVX2/FMA or
    it cannot be built; callers then keep the draft in int8 (reason printed once)."""
    if os.environ.get("SPECDECODE_NATIVE", "1") == "0":
        return None
    if not cpu_has_avx2_fma():
        return _int4_unavailable("this CPU lacks AVX2/FMA")
    return _build(INT4_SOURCE, "linear_int4", int4_flags(), _int4_unavailable)


GGUF_ISAS = ("portable", "avx2", "vnni")


def _vnni_flags() -> list[str]:
    """Flags that give the GGUF kernel 256-bit VNNI (VPDPWSSD, VPDPBUSD): from AVX-512 VNNI with
    VL (unless ``SPECDECODE_AVX512`` is 0) or from AVX-VNNI; empty where the CPU has neither."""
    cpu = _cpu_flags()
    if os.environ.get("SPECDECODE_AVX512", "1") != "0" and {"avx512f", "avx512vl", "avx512_vnni"} <= cpu:
        return ["-mavx512f", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"]
    return ["-mavxvnni"] if "avx_vnni" in cpu else []


def gguf_isas() -> list[str]:
    """The GGUF kernel's builds this CPU can run, slowest first: ``portable`` (plain C++),
    ``avx2`` (AVX2, FMA, F16C) and ``vnni`` (the AVX2 build with VNNI's fused integer
    multiply-adds). All give the same bits (see the kernel's header)."""
    if not cpu_has_avx2_fma():
        return ["portable"]
    return ["portable", "avx2", "vnni"] if _vnni_flags() else ["portable", "avx2"]


def gguf_isa() -> str:
    """The GGUF build to use: ``SPECDECODE_GGUF_ISA`` when set (``SPECDECODE_GGUF_PORTABLE=1``
    means portable), else the fastest this CPU runs."""
    forced = os.environ.get("SPECDECODE_GGUF_ISA") or (
        "portable" if os.environ.get("SPECDECODE_GGUF_PORTABLE") == "1" else None)
    if forced is None:
        return gguf_isas()[-1]
    _check_isa(forced, "SPECDECODE_GGUF_ISA=")
    return forced


def _check_isa(isa: str, label: str = "") -> None:
    """Refuse, by name, a GGUF build that does not exist or that this CPU cannot run."""
    if isa not in GGUF_ISAS:
        raise UnsupportedModelError(f"{label}{isa} is not a GGUF kernel build; the builds are "
                                    f"{', '.join(GGUF_ISAS)}")
    if isa not in gguf_isas():
        why = " (SPECDECODE_AVX512=0 turns off its AVX-512 VNNI form)" if isa == "vnni" and \
            os.environ.get("SPECDECODE_AVX512") == "0" else ""
        raise UnsupportedModelError(f"{label}{isa} cannot run here{why}; this CPU runs {', '.join(gguf_isas())}")


def gguf_flags(isa: str) -> list[str]:
    """Compiler flags of the GGUF kernel's ``isa`` build (one of ``GGUF_ISAS``). Floats are
    never contracted implicitly: every build rounds exactly alike (see the kernel's header)."""
    if isa not in GGUF_ISAS:
        raise ValueError(f"unknown GGUF kernel build {isa!r}; the builds are {', '.join(GGUF_ISAS)}")
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if isa == "portable":
        return flags
    flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags + _vnni_flags() if isa == "vnni" else flags


def _default_build(load: Callable[[str], ModuleType], what: str) -> ModuleType:
    """``load`` of the build models use here (``gguf_isa()``). A default VNNI build that fails
    (say, a compiler too old for ``-mavxvnni``) falls back to the AVX2 build, which has the same
    bits; one asked for by name (``SPECDECODE_GGUF_ISA``) does not."""
    isa = gguf_isa()
    if isa != "vnni" or os.environ.get("SPECDECODE_GGUF_ISA"):
        return load(isa)
    try:
        return load("vnni")
    except UnsupportedModelError as exc:
        log.warning(f"specdecode: {what}'s VNNI build failed, using its AVX2 build ({exc})")
        return load("avx2")


@functools.cache
def load_gguf(isa: str | None = None) -> ModuleType:
    """The GGUF kernel (``csrc/linear_gguf.cpp``) in its ``isa`` build (default ``gguf_isa()``),
    built on first use. Native GGUF models need it, so a failed build raises
    ``UnsupportedModelError`` naming ``--quantize none``; a default VNNI build that fails (say, a
    compiler too old for ``-mavxvnni``) falls back to the AVX2 build, which has the same bits."""
    if isa is None:
        if not cpu_has_avx2_fma():
            log.warning("specdecode: this CPU lacks AVX2/FMA; GGUF models run on the portable kernel (slower)")
        return _default_build(load_gguf, "the GGUF kernel")
    _check_isa(isa)

    def failed(reason: str) -> None:
        raise UnsupportedModelError(f"the native GGUF kernel is unavailable: {reason}; "
                                    "run the model dequantized with --quantize none")

    return _build(GGUF_SOURCE, "linear_gguf", gguf_flags(isa), failed)


@functools.cache
def load_attention(isa: str | None = None) -> ModuleType:
    """The row-wise attention (``csrc/attention_rows.cpp``) native GGUF models use, built with the
    GGUF kernel's ``isa`` flags (default: the build GGUF models use here, ``gguf_isa()``): it has
    no integer products, but the VNNI build's AVX-512VL gives its blocks of heads 32 vector
    registers (``csrc/attention.h``). All builds give the same bits. A failed build raises the
    same refusal as the GGUF kernel's, naming ``--quantize none``; a default VNNI build that fails
    falls back to the AVX2 build."""
    if isa is None:
        return _default_build(load_attention, "the attention kernel")
    _check_isa(isa)

    def failed(reason: str) -> None:
        raise UnsupportedModelError(f"the native attention kernel is unavailable: {reason}; "
                                    "run the model dequantized with --quantize none")

    return _build(ATTENTION_SOURCE, "attention_rows", gguf_flags(isa), failed)


# Part of every build folder's name: it changes when the way processes share a folder changes, so
# a process of an older version (one that loads without our flock) never builds in the same one.
FOLDER_USE = b"flock-1"


def _build(source: Path, name: str, flags: list[str], unavailable) -> ModuleType | None:
    """Compile ``source`` once per (source, torch, flags) into the kernels folder and load it."""
    from torch.utils import cpp_extension  # imported by a build only: some 0.14 s

    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what sources include
    key = FOLDER_USE + source.read_bytes() + headers + torch.__version__.encode() + str(flags).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    root = os.environ.get("SPECDECODE_KERNELS") or specdecode_home() / "kernels"
    build = Path(root) / digest
    with file_lock(build / ".specdecode.lock", f"the build of the {name} kernel") as locked:
        if locked and remove_stale_baton(build):
            log.warning(f"specdecode: removed {build / 'lock'}, left by a build that was killed")
        built = build / f"specdecode_{name}_{digest}.so"
        if built.is_file():  # the key covers what the library depends on: another venv may load it
            try:
                return _load_library(built)
            except (ImportError, OSError):
                pass  # damaged or half written: build it again
        try:
            return cpp_extension.load(
                name=f"specdecode_{name}_{digest}",
                sources=[str(_staged(source, build))],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the portable path
            return unavailable(f"building it failed ({str(exc).splitlines()[0][:200]})")


def _load_library(path: Path) -> ModuleType:
    """An extension module built earlier, imported without torch's ninja step: ninja rebuilds
    whenever its build file changes, and that file names the venv's torch headers, so every new
    venv (each fresh clone, each CI run) would recompile every kernel for minutes."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _staged(source: Path, build: Path) -> Path:
    """``source`` and the headers beside it, copied into ``build`` (unchanged copies left as they
    are): the copy is what compiles. ninja rebuilds when a source's path changes, so compiling the
    checkout's own file would rebuild every kernel for every clone (minutes each time) although the
    key says it is the same build. Call it holding the folder's lock."""
    build.mkdir(parents=True, exist_ok=True)
    for file in [source, *sorted(source.parent.glob("*.h"))]:
        dest, data = build / file.name, file.read_bytes()
        if not dest.is_file() or dest.read_bytes() != data:
            dest.write_bytes(data)
    return build / source.name


def remove_stale_baton(build: Path) -> bool:
    """Delete torch's ``lock`` file in ``build``; call it only while holding our lock on the folder.

    ``cpp_extension.load`` marks a build under way with that file and waits, without limit, for
    it to vanish. A process killed mid-build (even mid no-op check) leaves it behind, and every
    later load of that kernel would hang. Our ``flock`` dies with its holder, so while we hold it
    no other load of ours is inside ``cpp_extension.load`` and a ``lock`` file there is stale.
    """
    try:
        (build / "lock").unlink()
    except FileNotFoundError:
        return False
    return True


def _int4_unavailable(reason: str) -> None:
    log.warning(f"specdecode: int4 draft kernel unavailable, {reason}; the draft stays int8")
    return None


def _unavailable(reason: str) -> None:
    log.warning(f"specdecode: native kernel unavailable, {reason}; using the slower portable path")
    return None
