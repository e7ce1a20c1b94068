"""Turn the export's inputs into a checked ``ExportPlan`` before a byte is written.

Everything that can be refused is refused here, in seconds: a method vLLM lacks, a draft or head
that does not fit the target, a K that vLLM would build wrongly (Medusa builds exactly K heads),
a bench folder without advice. Only then are gigabytes of weights written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdecode.config import DEFAULT_DRAFTS, DEFAULT_MODEL
from specdecode.drafters.vocab import same_vocabulary
from specdecode.errors import InvalidConfigError
from specdecode.export.choices import DEFAULT_VLLM_K, EXPORT_DTYPES
from specdecode.export.model_files import source_folder, stored_dtype
from specdecode.export.vllm import ExportPlan, vllm_method
from specdecode.heads.eagle3_format import load_head_for
from specdecode.heads.folders import read_config
from specdecode.heads.medusa_format import load_medusa_for
from specdecode.models.catalog import resolve_model
from specdecode.models.config import ModelConfig
from specdecode.tokenizer import Tokenizer
from specdecode.params import MAX_SPECULATIVE_TOKENS


def bench_advice(bench_dir: Path, method: str | None) -> tuple[str, int | None, dict[str, Any]]:
    """(method, K, summary) from a ``specdecode bench`` folder: the method its advice names (or
    ``method``) at the K that served that method best there."""
    path = Path(bench_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
        advice = summary["advice"]
    except FileNotFoundError:
        raise InvalidConfigError(f"--from-bench {bench_dir}: no summary.json; pass the --out folder of a "
                                 "`specdecode bench` run") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidConfigError(f"--from-bench {bench_dir}: summary.json is unreadable ({exc})") from None
    if summary.get("synthetic_acceptance"):
        raise InvalidConfigError(f"--from-bench {bench_dir}: that run forced its acceptance "
                                 "(--synthetic-acceptance); hand over a real run's advice")
    chosen = method or advice.get("best_method")
    if chosen is None:
        raise InvalidConfigError(f"--from-bench {bench_dir}: its advice names no method ({advice.get('reason', '')}); "
                                 "pass --method")
    if chosen == "none":
        return chosen, None, summary
    entry = (advice.get("per_method") or {}).get(chosen)
    if not entry or entry.get("best_k") is None:
        ran = ", ".join(advice.get("per_method") or {}) or "none"
        raise InvalidConfigError(f"--from-bench {bench_dir}: method {chosen!r} did not run there (it ran {ran}); "
                                 "bench it first or pass -k")
    return chosen, int(entry["best_k"]), summary


def plan_export(*, model: str | None, method: str | None, draft: str | None, eagle_head: str | None,
                medusa_heads: str | None, k: int | None, from_bench: Path | None, dtype: str | None,
                tensor_parallel_size: int, progress: bool = True, cast_weights: bool = True) -> ExportPlan:
    """Check the inputs and resolve models; raises ``InvalidConfigError`` and friends with the fix.
    ``cast_weights=False`` keeps the weights as stored (hard-linked) and lets vLLM cast them to
    ``dtype`` when it loads them (the bench's exports: no gigabytes written per contestant)."""
    if tensor_parallel_size < 1:
        raise InvalidConfigError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidConfigError(f"-k must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise InvalidConfigError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if eagle_head and medusa_heads:
        raise InvalidConfigError("pass --eagle-head or --medusa-heads, not both: vLLM runs one drafter per server")
    k_source = "-k"
    summary: dict[str, Any] = {}
    notes: list[str] = []
    if from_bench is not None:
        if k is not None:
            raise InvalidConfigError("pass -k or --from-bench, not both")
        method, k, summary = bench_advice(from_bench, method)
        k_source = f"the best K for {method} in the bench run {from_bench} ({summary.get('created', '')})"
        if (summary.get("settings") or {}).get("k_schedule") != "fixed" and method != "none":
            notes.append("The bench ran K adaptively (up to K) and vLLM drafts K every step; "
                         "`specdecode bench --k-schedule fixed --sweep-k 2,3,4,5,6` measures the K to hand over.")
    model = model or summary.get("model") or DEFAULT_MODEL
    method = method or _implied_method(eagle_head, medusa_heads)
    vmethod = vllm_method(method)
    target = resolve_model(model, progress)
    draft_dir = head = None
    heterogeneous = False
    if method == "draft_model":
        draft = draft or summary.get("draft") or DEFAULT_DRAFTS.get(model)
        if draft is None:
            raise InvalidConfigError(f"method draft_model needs --draft: {model!r} has no default draft")
        draft_dir = resolve_model(draft, progress)
        heterogeneous = not _same_vocabulary(target, draft_dir)
        if heterogeneous:
            notes.append("The draft speaks another vocabulary: vLLM drafts on the tokens both vocabularies share "
                         "(`use_heterogeneous_vocab`, greedy drafts only).")
    elif draft:
        raise InvalidConfigError(f"--draft applies to method draft_model, not {method}")
    if method in ("eagle", "medusa"):
        head_arg = eagle_head if method == "eagle" else medusa_heads
        if not head_arg:
            flag = "--eagle-head" if method == "eagle" else "--medusa-heads"
            raise InvalidConfigError(f"method {method} needs {flag} DIR (a head made by `specdecode train`)")
        head = Path(head_arg)
        _check_head(method, head, target)
    elif eagle_head or medusa_heads:
        raise InvalidConfigError(f"--eagle-head and --medusa-heads apply to methods eagle and medusa, not {method}")
    if vmethod is None:
        k, k_source = None, "plain decoding"
    elif method == "medusa":
        k, k_source = _medusa_k(head, k, k_source)  # type: ignore[arg-type]
    elif k is None:
        k, k_source = DEFAULT_VLLM_K, f"the default ({DEFAULT_VLLM_K}; vLLM's K is fixed per server, pass -k or " \
                                      "--from-bench to choose it)"
    if method == "suffix":
        notes.append("vLLM's suffix decoding needs the arctic-inference package and grows its tree from the "
                     "prompts and earlier answers it serves; a --datastore of ours is not carried over.")
    chosen_dtype = dtype or stored_dtype(source_folder(target, progress))
    return ExportPlan(method=method, vllm_method=vmethod, k=k, k_source=k_source, target=target,
                      target_name=_served_name(model, target), dtype=chosen_dtype,
                      tensor_parallel_size=tensor_parallel_size, draft=draft_dir, heterogeneous_vocab=heterogeneous,
                      head=head, notes=notes, cast_weights=cast_weights)


def _implied_method(eagle_head: str | None, medusa_heads: str | None) -> str:
    if eagle_head:
        return "eagle"
    if medusa_heads:
        return "medusa"
    return "draft_model"


def _check_head(method: str, head: Path, target: Path) -> None:
    """Load the head once and check it fits the target, before any weights are written."""
    config = ModelConfig.from_dir(target)
    if method == "eagle":
        load_head_for(head, config, target)
    else:
        load_medusa_for(head, config, target)


def _medusa_k(head: Path, k: int | None, k_source: str) -> tuple[int, str]:
    """vLLM builds exactly K Medusa heads: K must not exceed the folder's heads (default: all)."""
    config = read_config(head)
    heads = int(config.get("num_heads") or config.get("medusa_num_heads") or 0)
    if heads < 1:
        raise InvalidConfigError(f"{head}/config.json names no Medusa heads (num_heads)")
    if k is None:
        return heads, f"the number of Medusa heads in {head} (vLLM builds K heads)"
    if k > heads:
        raise InvalidConfigError(f"K={k} but {head} holds {heads} Medusa heads; vLLM builds exactly K heads, so "
                                 f"K must be at most {heads}")
    return k, k_source


def _same_vocabulary(target: Path, draft: Path) -> bool:
    return same_vocabulary(Tokenizer.from_dir(target), Tokenizer.from_dir(draft),
                           ModelConfig.from_dir(target).vocab_size, ModelConfig.from_dir(draft).vocab_size)


def _served_name(model: str, target: Path) -> str:
    """The catalog name as given, else the folder's name: what clients send as ``model``."""
    if Path(model).exists():
        return Path(model).resolve().name.removesuffix(".gguf")
    return model.rstrip("/").rsplit("/", 1)[-1]
