"""Write a benchmark's outputs: results.jsonl, summary.json, summary.md and PNG plots.

results.jsonl is written row by row while the benchmark runs (``ResultsWriter``), so an
interrupted run still leaves every finished measurement on disk. Plots use matplotlib's Agg
backend, imported only here, so the benchmark works on headless machines.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
MARKDOWN_FILE = "summary.md"
SPEEDUP_PLOT = "speedup_by_category.png"
ACCEPTANCE_PLOT = "acceptance_by_position.png"


class ResultsWriter:
    """Append one JSON object a line and flush it at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None

    def __enter__(self) -> ResultsWriter:
        self._file = self.path.open("w", encoding="utf-8")
        return self

    def __call__(self, row: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError("ResultsWriter used outside its with-block")
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._file is not None:
            self._file.close()


def write_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """summary.json, the plots, then summary.md (which links the plots that were made)."""
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    plots = write_plots(summary, out)
    (out / MARKDOWN_FILE).write_text(render_markdown(summary, [p.name for p in plots]), encoding="utf-8")
    return [out / SUMMARY_FILE, out / MARKDOWN_FILE, *plots]


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return f"{value:{spec}}{suffix}"


def _speedup(m: dict[str, Any]) -> str:
    """A method's speed-up over ``none``, with its 95% interval over the prompts where there is one."""
    interval = m.get("speedup_vs_none_interval")
    shown = _fmt(m["speedup_vs_none"], ".2f", "x")
    return f"{shown} ({interval[0]:.2f}-{interval[1]:.2f})" if interval and m["speedup_vs_none"] is not None else shown


def render_markdown(summary: dict[str, Any], plots: list[str] | None = None) -> str:
    """The summary as tables a person reads: methods, peers, categories, advice, failures."""
    lines = _header(summary)
    versus_peers = [(key, label) for key, label in (("speedup_vs_llamacpp", "vs llama.cpp"), ("speedup_vs_vllm", "vs vLLM"))
                    if any(key in m for m in summary["methods"].values())]
    lines += ["", "| method | K | tok/s | vs none | vs HF " + "".join(f"| {label} " for _, label in versus_peers)
              + "| tau | tokens/forward | acceptance | TTFT s | TPOT ms | identical | limit tok/s | efficiency |",
              "|---|---|---|---|---" + "|---" * len(versus_peers) + "|---|---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        versus = "".join(f"| {_fmt(m.get(key), '.2f', 'x')} " for key, _ in versus_peers)
        lines.append(
            f"| {name} | {_fmt(m.get('k'), 'd')} | {_fmt(m['tokens_per_s'])} | {_speedup(m)} "
            f"| {_fmt(m.get('speedup_vs_hf'), '.2f', 'x')} {versus}| {_fmt(m['mean_acceptance_length'])} "
            f"| {_fmt(m.get('mean_accepted_tokens'))} | {_fmt(m['acceptance_rate'], '.0%')} | {_fmt(m['ttft_s'])} | {_fmt(_ms(m['tpot_s']), '.0f')} "
            f"| {_fmt(m['identical_to_none'])} | {_fmt(m.get('limit_tokens_per_s'))} | {_fmt(m.get('efficiency'), '.0%')} |"
        )
    if summary.get("peers"):
        lines += ["", "## Peers: other engines on the same models", "",
                  "| peer | tok/s | vs our none | tau | acceptance | TTFT s | TPOT ms | identical to ours "
                  "| tokens agreeing | first divergences | settings |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, p in summary["peers"].items():
            settings = ", ".join(f"{k}={v}" for k, v in p.get("settings", {}).items())
            agreeing = (f"{p['agreed_tokens']}/{p['compared_tokens']} ({p['agreement']:.0%})"
                        if p.get("agreement") is not None else "-")
            parted = ", ".join(map(str, p.get("first_divergences") or [])) or "-"
            lines.append(f"| {name} | {_fmt(p['tokens_per_s'])} | {_fmt(p['speedup_vs_none'], '.2f', 'x')} "
                         f"| {_fmt(p.get('mean_acceptance_length'))} | {_fmt(p.get('acceptance_rate'), '.0%')} "
                         f"| {_fmt(p['ttft_s'])} | {_fmt(_ms(p['tpot_s']), '.0f')} | {_fmt(p['identical_to_ours'])} "
                         f"| {agreeing} | {parted} | {settings} |")
    lines += _category_table(summary)
    lines += _turn_table(summary)
    lines += _advice_lines(summary)
    lines += _failure_lines(summary)
    lines += [""] + [f"![{name}]({name})" for name in plots or []]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _header(summary: dict[str, Any]) -> list[str]:
    mach = summary.get("machine", {})
    settings = summary.get("settings", {})
    draft = f", draft {summary['draft']}" if summary.get("draft") else ""
    weights = summary.get("dtype")
    if settings.get("quantize") not in (None, "none"):  # a different model: say so in the title
        weights = f"{settings['quantize']} target weights, {weights} activations"
    lines = [f"# specdecode bench: {summary.get('model')}{draft} ({weights})", "",
             f"{summary.get('created', '')} · {mach.get('cpu', '?')} · {mach.get('cpu_count', '?')} cores, "
             f"{mach.get('torch_threads', '?')} torch threads · {mach.get('memory_gib', '?')} GiB · "
             f"torch {mach.get('torch', '?')}"]
    if summary.get("synthetic_acceptance"):
        rates = ", ".join(f"{r:g}" for r in summary["synthetic_acceptance"])
        lines += ["", f"**SYNTHETIC ACCEPTANCE ({rates})**: drafts were kept by this law, not by the target, so "
                      "the +synthetic rows' outputs are not the target's. They measure the engine's drafting and "
                      "verifying costs at that acceptance, apart from any drafter's quality."]
    if summary.get("command"):
        lines += ["", f"Command: `{summary['command']}`"]
    if settings:
        shown = (f"{k} {','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in settings.items())
        lines += ["", "Settings: " + "; ".join(shown)]
    bracketed = any(m.get("speedup_vs_none_interval") for m in summary.get("methods", {}).values())
    notes = [f"Speedups: {summary.get('speedup_aggregation', '')}"
             + ("; beside ours, in brackets, a 95% bootstrap interval over the prompts." if bracketed else ".")]
    if summary.get("target_step_s"):
        notes.append(f"One single-token target step: {summary['target_step_s'] * 1e3:.1f} ms.")
    if summary.get("peak_rss_mb"):
        notes.append(f"Peak RSS: {summary['peak_rss_mb']:.0f} MB.")
    costs = summary.get("policy_costs")
    if costs and costs.get("step_s"):
        drafts = ", ".join(f"{name} {steps:.2f}" for name, steps in costs["draft_token_steps"].items())
        notes.append(f"The speculation policy's costs at the end of the run: a one-row step {costs['step_s'] * 1e3:.1f} "
                     f"ms, each extra verify row {costs['row_share']:.2f} of it"
                     + (f", a drafted token {drafts} of it." if drafts else "."))
    return lines + ["", " ".join(notes)]


def _category_table(summary: dict[str, Any], key: str = "speedup_vs_none", against: str = "none") -> list[str]:
    cats = summary.get("per_category", {})
    names = [n for n in list(summary["methods"]) + list(summary.get("peers", {})) if n != against]
    if not cats or not names:
        return []
    lines = ["", f"## Speedup vs {against} per category (tau in brackets)", "",
             "| category | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for cat, entries in cats.items():
        cells = []
        for n in names:
            e = entries.get(n)
            if e is None:
                cells.append("–")
                continue
            tau = e.get("mean_acceptance_length")
            cells.append(_fmt(e.get(key), ".2f", "x") + (f" ({tau:.2f})" if tau else ""))
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    if key == "speedup_vs_none" and any("speedup_vs_llamacpp" in e for c in cats.values() for e in c.values()):
        lines += _category_table(summary, "speedup_vs_llamacpp", "llamacpp_target")
    return lines


def _turn_table(summary: dict[str, Any]) -> list[str]:
    """Mean TTFT per conversation turn (and, for ours, prompt tokens reused from the prefix
    cache out of the prompt's); nothing for single-turn runs."""
    entries = {**summary["methods"], **summary.get("peers", {})}
    turns = {name: {t["turn"]: t for t in e["by_turn"]} for name, e in entries.items() if e.get("by_turn")}
    if not turns:
        return []
    names = list(turns)
    lines = ["", "## TTFT per turn, seconds (prompt tokens from the prefix cache / prompt tokens)", "",
             "| turn | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for turn in sorted({t for by in turns.values() for t in by}):
        cells = []
        for name in names:
            t = turns[name].get(turn)
            if t is None:
                cells.append("-")
                continue
            reused = t.get("cached_tokens")
            cells.append(_fmt(t["ttft_s"]) + (f" ({reused:.0f}/{t['prompt_tokens']:.0f})" if reused is not None else ""))
        lines.append(f"| {turn + 1} | " + " | ".join(cells) + " |")
    return lines


def _advice_lines(summary: dict[str, Any]) -> list[str]:
    advice = summary.get("advice") or {}
    if not advice.get("best_method"):
        return ["", "## Advice", "", advice.get("reason", "no advice")]
    k = f" with K={advice['best_k']}" if advice.get("best_k") else ""
    lines = ["", "## Advice", "", f"**Use {advice['best_method']}{k}**: {advice.get('reason', '')}"]
    for method, slot in advice.get("per_method", {}).items():
        by_k = ", ".join(f"K={k}: {v:.2f}x" for k, v in slot["by_k"].items() if v is not None)
        lines.append(f"- {method}: best K={slot['best_k']} ({by_k})")
    for cat, c in advice.get("per_category", {}).items():
        kk = f" K={c['best_k']}" if c.get("best_k") else ""
        lines.append(f"- {cat}: {c['best_method']}{kk} ({c['speedup_vs_none']:.2f}x)")
    return lines


def _failure_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    if summary.get("peer_errors"):
        lines += ["", "## Peers that could not run", ""]
        lines += [f"- {e['peer']}: {e['error']}" for e in summary["peer_errors"]]
    failures = summary.get("identity_failures") or []
    if not failures:
        return lines
    lines += ["", f"## IDENTITY FAILURES ({len(failures)}): speculative output differed from plain decoding", ""]
    lines += [f"- {f['method']} on {f['prompt_id']} turn {f['turn']} repeat {f['repeat']}: first difference "
              f"at token {f['first_mismatch']}" for f in failures]
    return lines


def write_plots(summary: dict[str, Any], out: Path) -> list[Path]:
    """Speedup per category and method; acceptance rate by draft position. [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    if _plot_speedups(plt, summary, out / SPEEDUP_PLOT):
        made.append(out / SPEEDUP_PLOT)
    if _plot_acceptance(plt, summary, out / ACCEPTANCE_PLOT):
        made.append(out / ACCEPTANCE_PLOT)
    return made


def _short(summary: dict[str, Any]) -> str:
    """Model names for a plot title: the last path component of each (folders can be long)."""
    model = Path(str(summary.get("model"))).name
    return f"{model} + {Path(str(summary['draft'])).name}" if summary.get("draft") else model


def _plot_speedups(plt: Any, summary: dict[str, Any], path: Path) -> bool:
    """Grouped bars: one group per category plus ``all``, one bar per method or peer."""
    cats = dict(summary.get("per_category", {}))
    entries = {**summary["methods"], **summary.get("peers", {})}
    names = [n for n in entries if n != "none"]
    if not cats or not names:
        return False
    cats["all"] = {n: {"speedup_vs_none": entries[n].get("speedup_vs_none")} for n in names}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(cats) * (len(names) + 1)), 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [(cats[c].get(name) or {}).get("speedup_vs_none") or 0.0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cats))], list(cats))
    ax.set_ylabel("speedup vs none (x)")
    ax.set_title(f"{_short(summary)}\nspeedup vs plain decoding per category (dashed line: 1x)", fontsize="medium")
    return _save(plt, fig, ax, path)


def _plot_acceptance(plt: Any, summary: dict[str, Any], path: Path) -> bool:
    series = {n: m["acceptance_by_position"] for n, m in summary["methods"].items() if m.get("acceptance_by_position")}
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for name, rates in series.items():
        points = [(i + 1, r) for i, r in enumerate(rates) if r is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0.0, 1.05)
    ax.set_title(f"{_short(summary)}\nacceptance rate by draft position", fontsize="medium")
    return _save(plt, fig, ax, path)


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> bool:
    """The common tail of every plot: legend, layout, PNG, and freeing the figure."""
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
