"""``specdecode generate``: one prompt, optionally compared against plain decoding."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode.cli.options import (add_draft_options, add_method_flag, add_method_options, add_model_options,
                                    add_prefix_cache_file_option, add_quantize_option, chosen_method, method_options,
                                    restore_prefix_cache, save_prefix_cache)
from specdecode.config import DEFAULT_DTYPE, DEFAULT_MAX_SEQ_LEN, DTYPES
from specdecode.params import MAX_LOGPROBS, Constraint, SamplingParams
from specdecode.errors import InvalidConfigError
from specdecode.files import read_user_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_method_flag(p, k_help="draft tokens proposed per step")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--prediction-file", type=Path, metavar="FILE",
                   help="text the output is expected to be close to (say, the file you ask to edit): drafted "
                        "from for free; the output is exactly the model's whatever it says")
    p.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message and apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples with exact rejection sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the top K tokens; 0 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_penalty_options(p)
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="compute dtype (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, help="context length to allocate (default: %(default)s)")
    add_draft_options(p)
    add_quantize_option(p)
    add_method_options(p)
    p.add_argument("--compare", action="store_true",
                   help="also run --method none on the same input and report speedup and identity (both "
                        "timed runs start from the same prefix cache: empty, or --prefix-cache-file's)")
    add_prefix_cache_file_option(p, "read before generating when it exists and written after (with --compare, "
                                    "each timed run starts from the file's prefixes)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each token's log-probability and the N most likely tokens at its position "
                        f"(0-{MAX_LOGPROBS}; in --json output as \"logprobs\", else on stderr)")
    shape = p.add_argument_group("structured output (one of; the output is exactly the constrained target's)")
    only = shape.add_mutually_exclusive_group()
    only.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    only.add_argument("--json-schema", metavar="JSON|FILE",
                      help="the output is JSON matching this schema (inline JSON text, or a file holding it)")
    only.add_argument("--regex", help="the output matches this regular expression (Rust regex syntax)")
    only.add_argument("--grammar", type=Path, metavar="FILE", help="the output matches this Lark grammar")
    only.add_argument("--choice", action="append", metavar="TEXT",
                      help="the output is exactly one of these texts (repeat the flag for each)")
    p.set_defaults(run=run)


def add_penalty_options(p: argparse.ArgumentParser) -> None:
    """Penalties and logit bias on the target's logits; speculative output stays exactly the
    penalised target's (sample/penalties.py)."""
    g = p.add_argument_group("penalties (the output is exactly the penalised target's, under every method)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="subtract P (in [-2, 2]) from the logit of every token already generated (default: 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F (in [-2, 2]) from a token's logit per time it was generated (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="for every token in the prompt or the output, divide a positive logit by R (> 0) and "
                        "multiply a negative one (default: 1 = off)")
    g.add_argument("--logit-bias", type=_bias_pair, action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit; -100 all but bans it (repeatable)")


def _bias_pair(text: str) -> tuple[int, float]:
    """``ID=BIAS`` as (token id, bias); the ranges are checked by SamplingParams."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 50256=-100), got {text!r}") from None


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The structured-output flag given, as a Constraint (None: free text)."""
    if args.json_object:
        return Constraint("json_object")
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith(("{", "true", "false")):
            text = _read_text(Path(text), "--json-schema")
        return Constraint("json_schema", text)
    if args.regex is not None:
        return Constraint("regex", args.regex)
    if args.grammar is not None:
        return Constraint("grammar", _read_text(args.grammar, "--grammar"))
    if args.choice:
        return Constraint.choice(args.choice)
    return None


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfigError(f"cannot read {flag} {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from specdecode.api import LLM

    prompt = _read_prompt(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), logprobs=args.logprobs,
                            constraint=constraint_from_args(args), presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            logit_bias=tuple(args.logit_bias) or None,
                            prediction=(read_user_text(args.prediction_file, "--prediction-file", MAX_PROMPT_FILE_BYTES)
                                        if args.prediction_file is not None else None))
    method = chosen_method(args)
    llm = LLM(model=args.model, draft=args.draft, method=method, num_speculative_tokens=args.k,
              dtype=args.dtype, max_seq_len=args.max_seq_len, progress=not args.json,
              adaptive=not args.fixed_k, draft_quantize=args.draft_quantize,
              draft_confidence=args.draft_confidence, draft_temperature=args.draft_temperature,
              draft_vocab=args.draft_vocab, quantize=args.quantize,
              **method_options(args, [method]))
    ids = llm.chat_prompt_ids([{"role": "user", "content": prompt}]) if args.chat else llm.tokenizer.encode(prompt)
    store = args.prefix_cache_file
    if not args.json and not args.compare:
        restore_prefix_cache(llm, store)
        for event in llm.events(ids, params):
            print(event.text, end="", flush=True)
            out = event.output
        print()
        save_prefix_cache(llm, store)
        _print_stats(out)
        _print_logprobs(out, llm.tokenizer)
        return 0
    if args.compare:  # the first forward pages the weights in; keep that out of both timings
        llm.generate(ids, SamplingParams(max_tokens=2))

    readable = store

    def start_alike() -> None:
        """Each timed run starts from the same kept prefixes (none, or the file's): their times
        compare. A file that could not be restored is not read (nor warned about) again."""
        nonlocal readable
        llm.clear_prefix_cache()
        if not restore_prefix_cache(llm, readable):
            readable = None

    start_alike()
    [out] = llm.generate(ids, params)
    if args.compare:
        start_alike()
    base = llm.generate(ids, params, method="none")[0] if args.compare else None
    save_prefix_cache(llm, store)
    if args.json:
        print(json.dumps(_report(out, base, llm.tokenizer)))
    else:
        print(out.text)
        _print_stats(out, base)
        _print_logprobs(out, llm.tokenizer)
    return 0


MAX_PROMPT_FILE_BYTES = 16 << 20  # far above any prompt that fits a context; stops /dev/zero


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    return read_user_text(args.prompt_file, "--prompt-file", MAX_PROMPT_FILE_BYTES)


def _report(out, base, tokenizer) -> dict:
    s = out.stats
    report = {
        "text": out.text, "token_ids": out.token_ids, "method": out.method,
        "finish_reason": out.finish_reason, "tokens_per_s": s.tokens_per_s,
        "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
        "stats": s.to_dict(),
    }
    if out.logprobs is not None:
        report["logprobs"] = [_logprob_json(lp, tokenizer) for lp in out.logprobs]
    if base is not None:
        report.update(_comparison(out, base))
    return report


def _comparison(out, base) -> dict:
    """``out`` against plain decoding's ``base`` (``--compare``)."""
    return {"baseline_tokens_per_s": base.stats.tokens_per_s,
            "speedup": out.stats.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0,
            "identical": out.token_ids == base.token_ids}


def _logprob_json(lp, tokenizer) -> dict:
    def text(token_id: int) -> str:
        return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    return {"token_id": lp.token_id, "token": text(lp.token_id), "logprob": lp.logprob,
            "top_logprobs": [{"token_id": i, "token": text(i), "logprob": v} for i, v in lp.top]}


def _print_logprobs(out, tokenizer) -> None:
    """One line per token on stderr: its text, logprob, and the alternatives."""
    for lp in out.logprobs or []:
        entry = _logprob_json(lp, tokenizer)
        alternatives = "  ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in entry["top_logprobs"])
        print(f"{entry['token']!r:>16} {entry['logprob']:8.3f}   {alternatives}", file=sys.stderr)


def _print_stats(out, base=None) -> None:
    s = out.stats
    line = (f"[{out.method}] {s.completion_tokens} tokens, {s.tokens_per_s:.2f} tok/s, "
            f"tau {s.mean_acceptance_length:.2f}, acceptance {s.acceptance_rate:.0%}, "
            f"ttft {s.ttft_s:.2f}s, finish {out.finish_reason}")
    if s.prediction_accepted or s.prediction_rejected:
        line += f", prediction tokens kept {s.prediction_accepted} refused {s.prediction_rejected}"
    print(line, file=sys.stderr)
    if base is not None:
        r = _comparison(out, base)
        print(f"[none] {base.stats.tokens_per_s:.2f} tok/s; speedup {r['speedup']:.2f}x; "
              f"identical to plain decoding: {r['identical']}", file=sys.stderr)
