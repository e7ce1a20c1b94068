"""Translation between OpenAI's request/response objects and the engine's.

Requests become ``(prompt_ids, SamplingParams)`` with every limit checked before anything is
queued, so a request that cannot fit the context fails fast with a 400 naming the field. Outputs
become OpenAI's response objects and Server-Sent Events, chunk for chunk as OpenAI sends them.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2

from specdecode.api import LLM
from specdecode.params import GREEDY_BELOW, Constraint, SamplingParams
from specdecode.engine.generation import GenerationOutput
from specdecode.sample.logprobs import TokenLogprob
from specdecode.tokenizer import Tokenizer
from specdecode.errors import PromptTooLongError, SpecDecodeError
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
    """A validated request, ready for the scheduler."""

    prompt_ids: list[int]
    params: SamplingParams


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
    return Prepared(ids, _params(req, llm, ids, req.max_tokens, "max_tokens", "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS))


def prepare_chat(req: ChatCompletionRequest, llm: LLM) -> Prepared:
    try:
        ids = llm.chat_prompt_ids([m.for_template() for m in req.messages])
    except jinja2.TemplateError as exc:  # the model's template rejects this conversation
        raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None
    limit_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    return Prepared(ids, _params(req, llm, ids, req.token_limit, limit_param, "messages", None))


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
    vocab = llm.target.config.vocab_size
    outside = next((t for t in req.logit_bias or {} if t >= vocab), None)
    if outside is not None:
        raise bad_request(f"logit_bias names token id {outside}, outside the vocabulary [0, {vocab})", "logit_bias",
                          "invalid_value")
    if constraint is not None and req.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with structured output: a finished grammar allows only "
                          "the end of the sequence", "ignore_eos", "invalid_value")
    try:
        return SamplingParams(
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


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives per token the request asked for (None: no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def constraint_param(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field that carried its constraint, for error messages."""
    asked = req.constraint()
    return asked[2] if asked else "response_format"


def spec_stats(output: GenerationOutput) -> SpecDecodeStats:
    s = output.stats
    return SpecDecodeStats(method=output.method, drafts=s.drafts, draft_tokens=s.draft_tokens,
                           accepted_tokens=s.accepted_tokens, mean_acceptance_length=s.mean_acceptance_length,
                           acceptance_rate=s.acceptance_rate, accepted_per_position=list(s.accepted_per_position))


def usage(output: GenerationOutput) -> Usage:
    p, c, s = len(output.prompt_token_ids), len(output.token_ids), output.stats
    details = CompletionTokensDetails(accepted_prediction_tokens=s.prediction_accepted,
                                      rejected_prediction_tokens=s.prediction_rejected)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, completion_tokens_details=details,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=s.cached_tokens))


def completion_body(model: str, output: GenerationOutput, tokenizer: Tokenizer) -> dict[str, Any]:
    logprobs = None if output.logprobs is None else completion_logprobs(output.logprobs, tokenizer)
    return CompletionResponse(
        id=_id("cmpl"), created=int(time.time()), model=model,
        choices=[CompletionChoice(text=output.text, logprobs=logprobs, finish_reason=output.finish_reason)],
        usage=usage(output), spec_decode=spec_stats(output),
    ).model_dump(mode="json")


def chat_body(model: str, output: GenerationOutput, tokenizer: Tokenizer) -> dict[str, Any]:
    logprobs = None if output.logprobs is None else chat_logprobs(output.logprobs, tokenizer)
    return ChatCompletionResponse(
        id=_id("chatcmpl"), created=int(time.time()), model=model,
        choices=[ChatChoice(message=AssistantMessage(content=output.text), logprobs=logprobs,
                            finish_reason=output.finish_reason)],
        usage=usage(output), spec_decode=spec_stats(output),
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
    """One stream's Server-Sent Events, in OpenAI's order: (chat: a role chunk), text chunks, a
    chunk with ``finish_reason`` and ``spec_decode``, (with ``include_usage``: a chunk with empty
    ``choices``, ``usage`` and ``spec_decode``), then ``data: [DONE]``."""

    DONE = "data: [DONE]\n\n"

    def __init__(self, chat: bool, model: str, include_usage: bool, tokenizer: Tokenizer | None = None) -> None:
        self.chat, self.model, self.include_usage, self.tokenizer = chat, model, include_usage, tokenizer
        self.id, self.created = _id("chatcmpl" if chat else "cmpl"), int(time.time())
        self._offset = 0  # characters of token text sent so far (completions' text_offset)

    def start(self) -> list[str]:
        return [self._chunk(ChatDelta(role="assistant", content=""))] if self.chat else []

    def text(self, piece: str, logprobs: list[TokenLogprob] | None = None) -> str:
        """A chunk with the step's text and, when asked for, its tokens' logprobs."""
        if logprobs and self.tokenizer is not None:
            if self.chat:
                return self._chunk(ChatDelta(content=piece), logprobs=chat_logprobs(logprobs, self.tokenizer))
            lps = completion_logprobs(logprobs, self.tokenizer, self._offset)
            self._offset += sum(len(t) for t in lps.tokens)
            return self._chunk(piece, logprobs=lps)
        return self._chunk(ChatDelta(content=piece) if self.chat else piece)

    def end(self, output: GenerationOutput) -> list[str]:
        stats = spec_stats(output)
        events = [self._chunk(ChatDelta() if self.chat else "", output.finish_reason, stats=stats)]
        if self.include_usage:
            events.append(self._chunk(None, usage=usage(output), stats=stats))
        return events + [self.DONE]

    def error(self, err: APIError) -> list[str]:
        return [_sse(err.body()), self.DONE]

    def _chunk(self, content: ChatDelta | str | None, finish: str | None = None, *,
               usage: Usage | None = None, stats: SpecDecodeStats | None = None,
               logprobs: ChatLogprobs | CompletionLogprobs | None = None) -> str:
        """``content`` None makes the usage chunk (no choices)."""
        common = dict(id=self.id, created=self.created, model=self.model, usage=usage, spec_decode=stats)
        if self.chat:
            choices = [] if content is None else [ChatChunkChoice(delta=content, finish_reason=finish,
                                                                  logprobs=logprobs)]
            body = ChatCompletionChunk(choices=choices, **common).model_dump(mode="json")
            for choice in body["choices"]:  # a delta carries only the keys it sets; {} at the end
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        else:
            choices = [] if content is None else [CompletionChoice(text=content, finish_reason=finish,
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
