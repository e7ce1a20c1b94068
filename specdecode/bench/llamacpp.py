"""llama.cpp as a benchmark peer: its own ``llama-server`` on the same GGUF files.

llama.cpp is what CPU users run, so it is the peer that decides whether specdecode is worth
using on a CPU. Two contestants, each a ``llama-server`` process started for the bench and
stopped after it: ``llamacpp_target`` (plain decoding) and, with a draft model,
``llamacpp_draft`` (its draft-model mode, ``--spec-type draft-simple``, with llama.cpp's default
draft settings unless ``--llamacpp-args`` says otherwise).

Both are benchmarked through the same streaming HTTP client as ``--endpoint`` (TTFT, TPOT,
tokens/s), interleaved with our methods on the same prompts. Each request sends our chat
template's token ids to ``/v1/completions``, so both engines start from the same tokens, and asks
for the generated token ids back (``return_tokens`` in llama.cpp's ``__verbose`` field), so the
report can say how many tokens of its greedy output agree with ours. They need not all agree:
llama.cpp quantizes activations differently, so its model is a slightly different function of
the same weights, and where two near-tied logits swap, the continuations part.
llama.cpp's prompt cache follows ours: with our prefix cache on (the default), each request sends
``cache_prompt: true``, so its slot reuses the common prefix of the previous request (a
conversation's earlier turns), as ours does; with ``--no-prefix-cache`` both prefill every turn
whole. Ours is emptied before each conversation, and llama.cpp's one slot last held another
conversation (contestants are interleaved per prompt), so neither carries a prompt over from one
conversation to the next beyond the chat template's first tokens.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from specdecode.bench.endpoint import endpoint_contestant, endpoint_url
from specdecode.bench.peers import PeerUnavailableError
from specdecode.bench.runner import Contestant
from specdecode.files import atomic_path, file_lock, remove_stale_partials, specdecode_home

log = logging.getLogger(__name__)

PLAIN, DRAFT = "llamacpp_target", "llamacpp_draft"
STARTUP_TIMEOUT_S = 600.0
# llama.cpp-specific request fields: token ids back (and ``cache_prompt``, set per bench).
REQUEST_EXTRA = {"return_tokens": True, "verbose": True}


def peer_gguf(model_dir: Path, progress: bool = True) -> Path:
    """The single GGUF file llama.cpp loads for a converted model folder.

    Catalog models ship their GGUF as byte-split parts (PyPI's size limit); llama.cpp needs one
    file, so the parts are joined once into ``$SPECDECODE_HOME/peers/gguf/`` (atomically).
    """
    from specdecode.errors import UnsupportedModelError
    from specdecode.models.gguf_convert import gguf_sources, join_parts

    try:
        sources = gguf_sources(model_dir)
    except UnsupportedModelError:
        raise PeerUnavailableError(f"llama.cpp runs GGUF files and {model_dir} was not converted from one; "
                                   "pass a catalog model or a .gguf file to compare with llama.cpp") from None
    if len(sources) == 1:
        return sources[0]
    size = sum(s.stat().st_size for s in sources)
    target = specdecode_home() / "peers" / "gguf" / f"{model_dir.name}.gguf"
    with file_lock(target.with_name(f".{target.name}.lock"), f"joining {target.name}", progress):
        remove_stale_partials(target.parent)
        if target.is_file() and target.stat().st_size == size:
            return target
        with atomic_path(target, sync=False) as partial:  # size-checked on use, joined again when short
            join_parts(sources, partial, progress)
    return target


class ServerProcess:
    """An HTTP server process on a free loopback port, ready when ``start`` returns: ``program``
    (llama-server, ``specdecode serve``, a vLLM export's ``serve.sh``) gets ``--host 127.0.0.1
    --port N`` appended and must answer ``GET /health`` with 200 once it can serve. It runs in a
    process group of its own, stopped whole: vLLM serves from child processes."""

    def __init__(self, program: Sequence[str], log_path: Path, startup_timeout: float = STARTUP_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> None:
        self.program, self.log_path, self.env = list(program), log_path, env
        self.name = Path(self.program[0]).name
        self.startup_timeout = startup_timeout
        self.port: int | None = None  # chosen by start(): a port picked long before may be taken by then
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} has not been started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [*self.program, "--host", "127.0.0.1", "--port", str(self.port) if self.port else "PORT"]

    def start(self) -> ServerProcess:
        self.port = _free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailableError(f"{self.name} exited with status {self.process.returncode} while "
                                           f"starting:\n{self._log_tail()}")
            if self._healthy():
                return self
            time.sleep(0.25)
        self.stop()
        raise PeerUnavailableError(f"{self.name} did not become ready within {self.startup_timeout:g} s; "
                                   f"see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the group (the server shuts its workers down); SIGKILL to whatever of the
        group is left after 30 s."""
        if self.process is None:
            return
        pid = self.process.pid
        try:
            _signal_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _group_alive(pid) and time.monotonic() < deadline:
                self.process.poll()  # reap the leader, or it stays a zombie and the group looks alive
                time.sleep(0.2)
        finally:  # also when a second Ctrl-C cuts the wait short: no server may outlive the bench
            if _group_alive(pid):
                _signal_group(pid, signal.SIGKILL)
            self.process.wait()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False  # not listening yet, or 503 while the model loads

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {self.log_path})"


def llamacpp_contestants(
    binary: Path, target_gguf: Path, draft_gguf: Path | None, *, threads: int, context: int, log_dir: Path,
    stack: ExitStack, timeout: float, extra_args: Sequence[str] = (), progress: bool = True,
    cache_prompt: bool = True,
) -> tuple[list[Contestant], dict[str, dict[str, Any]]]:
    """Start the servers (stopped when ``stack`` closes) and return their contestants and settings.
    ``cache_prompt``: llama.cpp reuses its slot's cached prompt prefix (as our prefix cache does)."""
    extra = {**REQUEST_EXTRA, "cache_prompt": cache_prompt}
    common = ["-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1", "--no-webui"]
    specs = [(PLAIN, ["-m", str(target_gguf), *common])]
    if draft_gguf is not None:
        specs.append((DRAFT, ["-m", str(target_gguf), *common, "-md", str(draft_gguf), "-td", str(threads),
                              "--spec-type", "draft-simple"]))
    version = server_version(binary)
    contestants, settings = [], {}
    for name, args in specs:
        args = [*args, *extra_args]
        if progress:
            log.info(f"bench: starting {name}: {binary.name} {shlex.join(args)}")
        server = ServerProcess([str(binary), *args], log_dir / f"{name}.log")
        stack.callback(server.stop)
        server.start()
        method = "draft_model" if name == DRAFT else "none"
        url = endpoint_url(server.url, "completions")
        contestants.append(endpoint_contestant(url, name, "completions", timeout, extra=extra, name=name,
                                               method=method, kind="peer"))
        settings[name] = {"library": f"llama.cpp {version}", "weights": "the same GGUF file(s)",
                          "command": shlex.join(server.command), "request": json.dumps(extra)}
    return contestants, settings


def server_version(binary: Path) -> str:
    """``llama-server --version``'s build line (it prints to stderr), or "unknown"."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
