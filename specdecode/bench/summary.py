"""Turn results rows into ``summary.json``: per-method figures, peers, categories and advice.

How figures are pooled (stated here because a benchmark is only as honest as its averages):

* ``tokens_per_s`` of a method = all its completion tokens / all its wall time (prefill included),
  over every prompt, turn and repeat. ``decode_tokens_per_s`` leaves out each request's TTFT.
* ``speedup_vs_none`` = the **geometric mean over prompts** of (method tokens/s on that prompt) /
  (``none`` tokens/s on the same prompt), each per-prompt rate pooled over its turns and repeats.
  Pairing by prompt keeps long and short answers from weighting the ratio, and the geometric
  mean is the one average of ratios that is symmetric (a 2x win and a 2x loss cancel).
  ``speedup_vs_none_interval`` = [low, high] for each of our methods: a 95% bootstrap interval
  of that mean (2000 resamples, seeded), each resample drawing as many prompts of each category
  as the run had, with replacement, from that category's: how far the figure would move on
  another draw of prompts like these in the same mix, each timed once more. Prompts within a
  category differ and each prompt's timing carries the host's noise, so over the 21 prompts of
  ``--workload all --limit 3`` a combined 1.26x spanned 1.23-1.30x and a 1.27x 1.19-1.35x
  (docs/BENCHMARKS.md, "At the defaults"): a goal inside the interval is not told apart from
  the figure. None with fewer
  than ``INTERVAL_MIN_PROMPTS`` prompts (with a handful the percentiles are just the extremes
  and hold the mean far less often than 95%), and for ``none`` itself.
  ``speedup_vs_hf`` is the same against ``hf_target`` and ``speedup_vs_llamacpp`` against
  ``llamacpp_target`` (llama.cpp's plain decoding); each is absent when that peer did not run.
* A peer's ``agreement`` = the tokens of its greedy outputs before their first divergence from
  our ``none`` output / the tokens of ours, over all its runs; ``first_divergences`` lists the
  positions where runs parted (empty when every run agreed to the end).
* ``mean_acceptance_length`` (tau) = 1 + accepted / drafts and ``acceptance_rate`` = accepted /
  drafted, pooled over all verify steps (vLLM's definitions); ``acceptance_by_position[i]`` =
  drafts whose token i was accepted / drafts that had a token i.
* ``mean_accepted_tokens`` = tokens emitted per target forward after prefill, over **every**
  forward, including those that carried no draft (an n-gram drafter with nothing to copy runs a
  plain one-token step). This is Spec-Bench's "mean accepted tokens" (its prompt-lookup baseline
  counts such steps as 1); tau above leaves them out, so the two differ only for drafters that
  sometimes propose nothing.
* ``limit_tokens_per_s`` = mean_accepted_tokens / (one single-token target forward, timed in the
  same run): what the method's forwards would yield if each cost one plain step, i.e. if
  drafting, verifying K extra rows and the engine were free. ``efficiency`` =
  ``decode_tokens_per_s`` / limit = (forwards x plain step time) / decode time: how much of the
  decode time those costs leave. Counting only drafted steps (tau) would put steps that drafted
  nothing above the limit they cannot exceed, so the limit would not be one.
"""

from __future__ import annotations

import math
import os
import platform
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from specdecode.bench.runner import BASELINE

SPEEDUP_AGGREGATION = ("geometric mean over prompts of per-prompt tokens/s ratios "
                       "(each prompt's tokens/s pooled over its turns and repeats)")
HF_BASELINE = "hf_target"
LLAMACPP_BASELINE = "llamacpp_target"
VLLM_BASELINE = "vllm_target"

Row = dict[str, Any]


def summarize(rows: Sequence[Row], meta: dict[str, Any], *, target_step_s: float | None = None,
              peak_rss_mb: float | None = None, failures: Sequence[Row] = (),
              peer_settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole summary. ``meta`` supplies model, draft, dtype, machine, settings and the like."""
    names = list(dict.fromkeys(r["method"] for r in rows))
    by_name = {n: [r for r in rows if r["method"] == n] for n in names}
    rates = {n: _per_prompt_rates(rs) for n, rs in by_name.items()}
    categories = {r["prompt_id"]: r["category"] for r in rows}
    baselines = {key: rates[name] for key, name in (("speedup_vs_hf", HF_BASELINE),
                                                    ("speedup_vs_llamacpp", LLAMACPP_BASELINE),
                                                    ("speedup_vs_vllm", VLLM_BASELINE)) if name in rates}
    methods: dict[str, Any] = {}
    peers: dict[str, Any] = {}
    for name, rs in by_name.items():
        entry = _aggregate(rs, target_step_s)
        entry["speedup_vs_none"] = _geomean_ratio(rates[name], rates.get(BASELINE))
        entry["speedup_vs_none_interval"] = (_geomean_interval(rates[name], rates.get(BASELINE), categories)
                                             if name != BASELINE else None)
        for key, base in baselines.items():
            entry[key] = _geomean_ratio(rates[name], base)
        if rs[0]["kind"] == "peer":
            peers[name] = _peer_entry(entry, rs, by_name.get(BASELINE, []), (peer_settings or {}).get(name, {}))
        else:
            methods[name] = entry
    per_category = _per_category(by_name)
    summary = dict(meta)
    summary.update(
        speedup_aggregation=SPEEDUP_AGGREGATION, target_step_s=target_step_s, peak_rss_mb=peak_rss_mb,
        methods=methods, peers=peers, per_category=per_category,
        advice=advise(methods, per_category), identity_failures=list(failures),
    )
    return summary


def _aggregate(rows: Sequence[Row], target_step_s: float | None) -> dict[str, Any]:
    first = rows[0]
    speculative = first["kind"] == "ours" and first["base_method"] != BASELINE
    tokens = sum(r["completion_tokens"] for r in rows)
    total = sum(r["total_s"] for r in rows)
    timed = [r for r in rows if r["ttft_s"] is not None]
    decode_s = sum(r["total_s"] - r["ttft_s"] for r in timed)
    decode_tokens = sum(max(r["completion_tokens"] - 1, 0) for r in timed)
    identity = [r["identical"] for r in rows if r["identical"] is not None]
    entry: dict[str, Any] = {
        "method": first["base_method"], "k": first["k"], "runs": len(rows),
        "prompts": len({r["prompt_id"] for r in rows}), "completion_tokens": tokens,
        "tokens_per_s": tokens / total if total > 0 else None,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "ttft_s": _mean(r["ttft_s"] for r in timed),
        "tpot_s": decode_s / decode_tokens if decode_tokens else None,
        "prefill_s": _mean(r["prefill_s"] for r in rows if r["prefill_s"] is not None),
        "mean_acceptance_length": None, "acceptance_rate": None, "acceptance_by_position": [],
        "identical_to_none": all(identity) if identity else None,
        "mismatches": sum(1 for i in identity if not i),
        "by_turn": _by_turn(rows),
    }
    if first["kind"] == "ours":
        entry.update(_acceptance(rows) if speculative else {"mean_acceptance_length": 1.0})
        steps = sum(r.get("target_steps") or 0 for r in timed)
        mat = decode_tokens / steps if steps else None
        entry["mean_accepted_tokens"] = mat
        limit = mat / target_step_s if target_step_s and mat else None
        entry["limit_tokens_per_s"] = limit
        entry["efficiency"] = entry["decode_tokens_per_s"] / limit if limit and entry["decode_tokens_per_s"] else None
        entry["time_split"] = _time_split(rows, total)
    elif first.get("drafts") is not None:  # a peer that reports its drafts (vLLM)
        entry.update(_acceptance(rows))
    return entry


def _by_turn(rows: Sequence[Row]) -> list[dict[str, Any]] | None:
    """Per turn of multi-turn conversations: mean TTFT, prompt tokens and (ours) prompt tokens
    taken from the prefix cache; None when every row is a first turn."""
    turns = sorted({r["turn"] for r in rows})
    if turns == [0]:
        return None
    out = []
    for turn in turns:
        at = [r for r in rows if r["turn"] == turn]
        cached = [r["cached_tokens"] for r in at if r.get("cached_tokens") is not None]
        out.append({"turn": turn, "runs": len(at), "ttft_s": _mean(r["ttft_s"] for r in at if r["ttft_s"] is not None),
                    "prompt_tokens": _mean(r["prompt_tokens"] for r in at),
                    "cached_tokens": _mean(cached) if cached else None})
    return out


def _time_split(rows: Sequence[Row], total: float) -> dict[str, float] | None:
    """Where our engine's wall time went: prefill, drafting, target verify steps, the rest
    (sampling, verification rules, detokenizing, Python), as fractions of the total."""
    if total <= 0:
        return None
    parts = {name: sum(r.get(f"{name}_s") or 0.0 for r in rows) for name in ("prefill", "draft", "verify")}
    split = {name: value / total for name, value in parts.items()}
    split["other"] = max(0.0, 1.0 - sum(split.values()))
    return split


def _acceptance(rows: Sequence[Row]) -> dict[str, Any]:
    drafts = sum(r["drafts"] or 0 for r in rows)
    drafted = sum(r["draft_tokens"] or 0 for r in rows)
    accepted = sum(r["accepted_tokens"] or 0 for r in rows)
    width = max((len(r["drafted_per_position"] or []) for r in rows), default=0)
    acc_pos, draft_pos = [0] * width, [0] * width
    for r in rows:
        for i, (a, d) in enumerate(zip(r["accepted_per_position"] or [], r["drafted_per_position"] or [])):
            acc_pos[i] += a
            draft_pos[i] += d
    return {
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_by_position": [a / d if d else None for a, d in zip(acc_pos, draft_pos)],
        "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
    }


def _peer_entry(entry: dict[str, Any], rows: Sequence[Row], reference: Sequence[Row],
                settings: dict[str, Any]) -> dict[str, Any]:
    """A peer's figures: speed, how far its greedy tokens agree with ours, and its acceptance where
    it reports one (vLLM's counters; HF and llama.cpp do not say)."""
    keep = ("tokens_per_s", "decode_tokens_per_s", "speedup_vs_none", "speedup_vs_hf", "speedup_vs_llamacpp",
            "speedup_vs_vllm", "ttft_s", "tpot_s", "runs", "prompts", "completion_tokens", "mismatches",
            "mean_acceptance_length", "acceptance_rate", "acceptance_by_position", "drafts", "draft_tokens",
            "accepted_tokens")
    peer = {k: entry[k] for k in keep if k in entry}
    peer["identical_to_ours"] = entry["identical_to_none"]
    peer.update(_agreement(rows, reference))
    peer["settings"] = settings
    return peer


def _agreement(rows: Sequence[Row], reference: Sequence[Row]) -> dict[str, Any]:
    """Tokens agreeing with our ``none`` before the first divergence, over the runs compared.

    A later turn counts only while every earlier turn of its conversation agreed: after a
    divergence the peer answers a different conversation, and comparing that says nothing.
    """
    ours = {(r["prompt_id"], r["turn"], r["repeat"]): len(r["token_ids"]) for r in reference}
    agreed = compared = 0
    divergences = []
    parted: set[tuple[str, int]] = set()
    for r in sorted(rows, key=lambda r: r["turn"]):
        length = ours.get((r["prompt_id"], r["turn"], r["repeat"]))
        if r["identical"] is None or length is None or (r["prompt_id"], r["repeat"]) in parted:
            continue
        if r["first_mismatch"] is not None:
            parted.add((r["prompt_id"], r["repeat"]))
        compared += length
        agreed += length if r["first_mismatch"] is None else min(r["first_mismatch"], length)
        if r["first_mismatch"] is not None:
            divergences.append(r["first_mismatch"])
    return {"agreed_tokens": agreed, "compared_tokens": compared,
            "agreement": agreed / compared if compared else None, "first_divergences": sorted(divergences)}


def _per_category(by_name: dict[str, list[Row]]) -> dict[str, dict[str, Any]]:
    categories = list(dict.fromkeys(r["category"] for rs in by_name.values() for r in rs))
    out: dict[str, dict[str, Any]] = {}
    for cat in categories:
        cat_rows = {n: [r for r in rs if r["category"] == cat] for n, rs in by_name.items()}
        base = _per_prompt_rates(cat_rows.get(BASELINE, []))
        llama = _per_prompt_rates(cat_rows.get(LLAMACPP_BASELINE, []))
        out[cat] = {}
        for name, rs in cat_rows.items():
            if not rs:
                continue
            tokens = sum(r["completion_tokens"] for r in rs)
            total = sum(r["total_s"] for r in rs)
            counted = rs[0]["kind"] == "ours" or rs[0].get("drafts") is not None
            acc = _acceptance(rs) if counted and rs[0]["base_method"] != BASELINE else {}
            out[cat][name] = {
                "tokens_per_s": tokens / total if total > 0 else None,
                "speedup_vs_none": _geomean_ratio(_per_prompt_rates(rs), base or None),
                "mean_acceptance_length": acc.get("mean_acceptance_length", 1.0 if rs[0]["kind"] == "ours" else None),
                "acceptance_rate": acc.get("acceptance_rate"),
            }
            if llama:
                out[cat][name]["speedup_vs_llamacpp"] = _geomean_ratio(_per_prompt_rates(rs), llama)
    return out


def advise(methods: dict[str, Any], per_category: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fastest exact method and its K, from measured speedups; per method its best K.

    A method that changed the output is never advised (it is listed under ``excluded``).
    """
    excluded = sorted(n for n, m in methods.items() if m["identical_to_none"] is False)
    ok = {n: m for n, m in methods.items()
          if n != BASELINE and n not in excluded and m["speedup_vs_none"] is not None}
    per_method: dict[str, Any] = {}
    for name, m in ok.items():
        slot = per_method.setdefault(m["method"], {"best_k": None, "speedup_vs_none": None, "by_k": {}})
        slot["by_k"][str(m["k"])] = m["speedup_vs_none"]
        if slot["speedup_vs_none"] is None or m["speedup_vs_none"] > slot["speedup_vs_none"]:
            slot.update(best_k=m["k"], speedup_vs_none=m["speedup_vs_none"], tokens_per_s=m["tokens_per_s"])
    advice: dict[str, Any] = {"best_method": None, "best_k": None, "speedup_vs_none": None,
                              "per_method": per_method, "per_category": _category_advice(per_category, ok),
                              "excluded": excluded}
    if BASELINE not in methods:
        advice["reason"] = "no 'none' baseline ran, so no speedup could be measured"
        return advice
    if not ok:
        advice.update(best_method=BASELINE, reason="no exact speculative method ran")
        return advice
    best = max(ok, key=lambda n: ok[n]["speedup_vs_none"])
    m = ok[best]
    if m["speedup_vs_none"] <= 1.0:
        advice.update(best_method=BASELINE, speedup_vs_none=1.0,
                      reason=f"no speculative method beat plain decoding (best: {best} at "
                             f"{m['speedup_vs_none']:.2f}x); use --method none")
        return advice
    advice.update(best_method=m["method"], best_k=m["k"], best_run=best, speedup_vs_none=m["speedup_vs_none"],
                  reason=f"{m['method']} with K={m['k']} was fastest: {m['speedup_vs_none']:.2f}x plain "
                         f"decoding ({SPEEDUP_AGGREGATION.split(' (')[0]}, {m['prompts']} prompt(s))")
    return advice


def _category_advice(per_category: dict[str, dict[str, Any]], ok: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for cat, entries in per_category.items():
        scored = {n: e["speedup_vs_none"] for n, e in entries.items() if n in ok and e["speedup_vs_none"]}
        if not scored:
            continue
        best = max(scored, key=scored.__getitem__)
        if scored[best] <= 1.0:
            out[cat] = {"best_method": BASELINE, "best_k": None, "speedup_vs_none": 1.0}
        else:
            out[cat] = {"best_method": ok[best]["method"], "best_k": ok[best]["k"], "speedup_vs_none": scored[best]}
    return out


def _per_prompt_rates(rows: Iterable[Row]) -> dict[str, float]:
    tokens: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for r in rows:
        tokens[r["prompt_id"]] += r["completion_tokens"]
        seconds[r["prompt_id"]] += r["total_s"]
    return {p: tokens[p] / seconds[p] for p in tokens if seconds[p] > 0 and tokens[p] > 0}


def _log_ratios(rates: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """log(rates[p] / base[p]) for each prompt p both measured, in prompt order."""
    return {p: math.log(rates[p] / base[p]) for p in sorted(rates) if p in base and base[p] > 0 and rates[p] > 0}


def _geomean_ratio(rates: dict[str, float], base: dict[str, float] | None) -> float | None:
    """Geometric mean of rates[p] / base[p] over the prompts both measured."""
    if not base:
        return None
    logs = list(_log_ratios(rates, base).values())
    return math.exp(sum(logs) / len(logs)) if logs else None


INTERVAL_RESAMPLES = 2000
INTERVAL_MIN_PROMPTS = 10


def _geomean_interval(rates: dict[str, float], base: dict[str, float] | None, categories: dict[str, str],
                      level: float = 0.95) -> list[float] | None:
    """A percentile bootstrap interval (``level``) of ``_geomean_ratio`` over the prompts both
    measured, resampled within each prompt's category (``categories``: prompt id -> category);
    the same resamples in every run (seeded), so a report is reproducible from its rows."""
    if not base:
        return None
    strata: dict[str, list[float]] = defaultdict(list)
    for p, log in _log_ratios(rates, base).items():
        strata[categories.get(p, "")].append(log)
    count = sum(len(logs) for logs in strata.values())
    if count < INTERVAL_MIN_PROMPTS:
        return None
    rng = random.Random(0)
    groups = [strata[c] for c in sorted(strata)]
    means = sorted(sum(sum(rng.choices(logs, k=len(logs))) for logs in groups) / count for _ in range(INTERVAL_RESAMPLES))
    tail = (1 - level) / 2
    low, high = means[round(tail * INTERVAL_RESAMPLES)], means[round((1 - tail) * INTERVAL_RESAMPLES) - 1]
    return [math.exp(low), math.exp(high)]


def _mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: CPU, cores, threads, memory, library versions."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "machine": platform.machine(), "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "memory_gib": _memory_gib(), "python": platform.python_version(), "torch": torch.__version__,
    }
    try:
        from importlib.metadata import version

        info["specdecode"] = version("specdecode")
        info["transformers"] = version("transformers")
    except Exception:  # noqa: BLE001 - a missing optional package only drops a field
        pass
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None
