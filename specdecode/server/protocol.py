"""Translation between OpenAI's request/response objects and the engine's.

Requests become ``(prompt_ids, SamplingParams)`` with every limit checked before anything is
queued, so a request that cannot fit the context fails fast with a 400 naming the field. Outputs
become OpenAI's response objects and Server-Sent Events, chunk for chunk as OpenAI sends them.

``n`` > 1 (and ``best_of``) asks for several samples of the prompt (``engine/samples.py``: sample i
takes seed ``seed + i``); they come back as ``choices`` 0..n-1. Usage counts the prompt once and
sums the completion tokens of every sample generated (``best_of``'s unreturned candidates
included, as OpenAI bills them); ``spec_decode`` sums the statistics of every sample the same way.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

import jinja2

from specdecode.api import LLM
from specdecode.params import GREEDY_BELOW, Constraint, SamplingParams
from specdecode.engine.generation import GenerationOutput
from specdecode.engine.stats import RequestStats
from specdecode.engine.samples import best, sample_params
from specdecode.sample.logprobs import TokenLogprob
from specdecode.tokenizer import Tokenizer
from specdecode.errors import InvalidSamplingParamsError, PromptTooLongError, SpecDecodeError
from specdecode.server.http_errors import APIError, bad_request, from_spec_error
from specdecode.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    PromptTokensDetails,
    SpecDecodeStats,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy (token-identical) output


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready for the scheduler: ``n`` choices out of ``best_of`` samples."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    best_of: int = 1

    @property
    def ranked(self) -> bool:
        """Whether the choices are the best ``n`` of more samples (by cumulative logprob)."""
        return self.best_of > self.n

    def samples(self) -> list[SamplingParams]:
        """Every sample's settings: seed ``seed + i``, logprobs on when they are ranked."""
        return sample_params(self.params, self.best_of, self.ranked)

    def choices(self, outputs: list[GenerationOutput]) -> list[GenerationOutput]:
        """The samples' outputs (in sample order) the response returns, in choice order."""
        return best(outputs, self.n, self.params.logprobs is not None) if self.ranked else outputs


def prepare_completion(req: CompletionRequest, llm: LLM) -> Prepared:
    if isinstance(req.prompt, str):
        ids = llm.tokenizer.encode(req.prompt)
    else:
        vocab = llm.target.config.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in prompt is outside the vocabulary [0, {vocab})", "prompt",
                              "invalid_value")
        ids = list(req.prompt)
    params = _params(req, llm, ids, req.max_tokens, "max_tokens", "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
    return Prepared(ids, params, req.n or 1, req.best_of or req.n or 1)


def prepare_chat(req: ChatCompletionRequest, llm: LLM) -> Prepared:
    try:
        ids = llm.chat_prompt_ids([m.for_template() for m in req.messages])
    except jinja2.TemplateError as exc:  # the model's template rejects this conversation
        raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None
    limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    return Prepared(ids, _params(req, llm, ids, req.token_limit, limit_param, "messages", None), req.n or 1,
                    req.n or 1)


def _params(req: CompletionRequest | ChatCompletionRequest, llm: LLM, ids: list[int], max_tokens: int | None,
            limit_param: str, prompt_param: str, default_max: int | None) -> SamplingParams:
    """Sampling settings, after checking that the prompt and ``max_tokens`` fit the context and
    that ``logit_bias`` names tokens of the vocabulary."""
    context = llm.engine.max_seq_len
    try:
        llm.engine.check_prompt(ids)
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
    room = context - len(ids)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens > room:
        raise APIError(
            400, f"{limit_param} is {max_tokens} but the context holds {context} tokens and the prompt uses "
            f"{len(ids)}: at most {room} new tokens fit; lower max_tokens or shorten the prompt",
            param=limit_param, code="context_length_exceeded")
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    try:
        asked = req.constraint()
    except ValueError as exc:
        raise bad_request(str(exc), "response_format", "invalid_value") from None
    constraint = None if asked is None else Constraint(asked[0], asked[1])
    if constraint is not None and req.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with structured output: a finished grammar allows only "
                          "the end of the sequence", "ignore_eos", "invalid_value")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,  # report it as greedy
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0), seed=req.seed, stop=req.stop, ignore_eos=bool(req.ignore_eos),
            logprobs=_logprobs(req), constraint=constraint,
            prediction=req.prediction.text() if req.prediction is not None else None,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias,
        )
    except SpecDecodeError as exc:
        raise from_spec_error(exc) from None
    try:
        llm.engine.check_params(params)  # what only the model can check: logit_bias's token ids
    except InvalidSamplingParamsError as exc:
        raise bad_request(str(exc), "logit_bias", "invalid_value") from None
    return params


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives per token the request asked for (None: no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def constraint_param(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field that carried its constraint, for error messages."""
    asked = req.constraint()
    return asked[2] if asked else "response_format"


def spec_stats(outputs: Sequence[GenerationOutput]) -> SpecDecodeStats:
    """The speculative-decoding statistics of one sample, or summed over several (vLLM's ratios
    of the sums, as ``RequestStats`` defines them)."""
    total = RequestStats(
        drafts=sum(o.stats.drafts for o in outputs), draft_tokens=sum(o.stats.draft_tokens for o in outputs),
        accepted_tokens=sum(o.stats.accepted_tokens for o in outputs),
        accepted_per_position=[sum(counts) for counts in
                               zip_longest(*(o.stats.accepted_per_position for o in outputs), fillvalue=0)])
    return SpecDecodeStats(method=outputs[0].method, drafts=total.drafts, draft_tokens=total.draft_tokens,
                           accepted_tokens=total.accepted_tokens, mean_acceptance_length=total.mean_acceptance_length,
                           acceptance_rate=total.acceptance_rate, accepted_per_position=total.accepted_per_position)


def usage(outputs: Sequence[GenerationOutput]) -> Usage:
    """The usage of samples of one prompt: the prompt once (its cached tokens are the first
    sample's; the others copy its prefill), the completion tokens of every sample."""
    p, c = len(outputs[0].prompt_token_ids), sum(len(o.token_ids) for o in outputs)
    details = CompletionTokensDetails(accepted_prediction_tokens=sum(o.stats.prediction_accepted for o in outputs),
                                      rejected_prediction_tokens=sum(o.stats.prediction_rejected for o in outputs))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, completion_tokens_details=details,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=outputs[0].stats.cached_tokens))


def completion_body(model: str, choices: Sequence[GenerationOutput], samples: Sequence[GenerationOutput],
                    tokenizer: Tokenizer) -> dict[str, Any]:
    """The response with ``choices``; usage and statistics over every sample generated."""
    return CompletionResponse(
        id=_id("cmpl"), created=int(time.time()), model=model,
        choices=[CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason,
                                  logprobs=None if o.logprobs is None else completion_logprobs(o.logprobs, tokenizer))
                 for i, o in enumerate(choices)],
        usage=usage(samples), spec_decode=spec_stats(samples),
    ).model_dump(mode="json")


def chat_body(model: str, choices: Sequence[GenerationOutput], samples: Sequence[GenerationOutput],
              tokenizer: Tokenizer) -> dict[str, Any]:
    """The response with ``choices``; usage and statistics over every sample generated."""
    return ChatCompletionResponse(
        id=_id("chatcmpl"), created=int(time.time()), model=model,
        choices=[ChatChoice(index=i, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason,
                            logprobs=None if o.logprobs is None else chat_logprobs(o.logprobs, tokenizer))
                 for i, o in enumerate(choices)],
        usage=usage(samples), spec_decode=spec_stats(samples),
    ).model_dump(mode="json")


def chat_logprobs(logprobs: list[TokenLogprob], tokenizer: Tokenizer) -> ChatLogprobs:
    """OpenAI's chat shape: each token with its bytes and its ``top_logprobs``."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = tokenizer.token_bytes(token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    return ChatLogprobs(content=[
        TokenLogprobOut(**top(lp.token_id, lp.logprob).model_dump(), top_logprobs=[top(i, v) for i, v in lp.top])
        for lp in logprobs])


def completion_logprobs(logprobs: list[TokenLogprob], tokenizer: Tokenizer, offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions shape: parallel lists; ``text_offset`` counts the characters of the
    token texts before each token, from ``offset`` (the text already streamed)."""
    texts = [tokenizer.token_bytes(lp.token_id).decode("utf-8", errors="replace") for lp in logprobs]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = [{tokenizer.token_bytes(i).decode("utf-8", errors="replace"): v for i, v in lp.top} for lp in logprobs]
    return CompletionLogprobs(tokens=texts, token_logprobs=[lp.logprob for lp in logprobs], top_logprobs=top,
                              text_offset=offsets)


class ChunkWriter:
    """One stream's Server-Sent Events, in OpenAI's order: (chat: a role chunk per choice), text
    chunks, for each choice a chunk with its ``finish_reason`` and ``spec_decode``, (with
    ``include_usage``: a chunk with empty ``choices``, ``usage`` and ``spec_decode`` over all
    choices), then ``data: [DONE]``. Each choice chunk carries its choice's ``index``; with ``n`` > 1
    the choices' chunks interleave as their tokens come."""

    DONE = "data: [DONE]\n\n"

    def __init__(self, chat: bool, model: str, include_usage: bool, tokenizer: Tokenizer | None = None,
                 n: int = 1) -> None:
        self.chat, self.model, self.include_usage, self.tokenizer, self.n = chat, model, include_usage, tokenizer, n
        self.id, self.created = _id("chatcmpl" if chat else "cmpl"), int(time.time())
        self._offsets = [0] * n  # characters of token text sent so far per choice (completions' text_offset)

    def start(self) -> list[str]:
        """The role chunk of each choice (chat), before any text."""
        if not self.chat:
            return []
        return [self._chunk(ChatDelta(role="assistant", content=""), index=i) for i in range(self.n)]

    def text(self, piece: str, logprobs: list[TokenLogprob] | None = None, index: int = 0) -> str:
        """A chunk with the step's text of choice ``index`` and, when asked for, its tokens' logprobs."""
        if logprobs and self.tokenizer is not None:
            if self.chat:
                return self._chunk(ChatDelta(content=piece), index=index,
                                   logprobs=chat_logprobs(logprobs, self.tokenizer))
            lps = completion_logprobs(logprobs, self.tokenizer, self._offsets[index])
            self._offsets[index] += sum(len(t) for t in lps.tokens)
            return self._chunk(piece, index=index, logprobs=lps)
        return self._chunk(ChatDelta(content=piece) if self.chat else piece, index=index)

    def finish(self, output: GenerationOutput, index: int = 0) -> str:
        """Choice ``index``'s last chunk: its ``finish_reason`` and its own ``spec_decode``."""
        return self._chunk(ChatDelta() if self.chat else "", output.finish_reason, index=index,
                           stats=spec_stats([output]))

    def close(self, outputs: Sequence[GenerationOutput]) -> list[str]:
        """After every choice finished: the usage chunk (when asked for) and ``[DONE]``."""
        if not self.include_usage:
            return [self.DONE]
        return [self._chunk(None, usage=usage(outputs), stats=spec_stats(outputs)), self.DONE]

    def error(self, err: APIError) -> list[str]:
        return [_sse(err.body()), self.DONE]

    def _chunk(self, content: ChatDelta | str | None, finish: str | None = None, *, index: int = 0,
               usage: Usage | None = None, stats: SpecDecodeStats | None = None,
               logprobs: ChatLogprobs | CompletionLogprobs | None = None) -> str:
        """``content`` None makes the usage chunk (no choices)."""
        common = dict(id=self.id, created=self.created, model=self.model, usage=usage, spec_decode=stats)
        if self.chat:
            choices = [] if content is None else [ChatChunkChoice(index=index, delta=content, finish_reason=finish,
                                                                  logprobs=logprobs)]
            body = ChatCompletionChunk(choices=choices, **common).model_dump(mode="json")
            for choice in body["choices"]:  # a delta carries only the keys it sets; {} at the end
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        else:
            choices = [] if content is None else [CompletionChoice(index=index, text=content, finish_reason=finish,
                                                                   logprobs=logprobs)]
            body = CompletionResponse(choices=choices, **common).model_dump(mode="json")
        if not self.include_usage:
            body.pop("usage")
        if stats is None:
            body.pop("spec_decode")
        return _sse(body)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
