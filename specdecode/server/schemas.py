"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests are strict: a wrong type is an error rather than a silent coercion ("0.5" is not a
temperature), and an unknown field is an error, as with OpenAI, so a misspelt option is never
ignored. Options OpenAI defines but we do not implement are accepted by the schema and refused by
:meth:`_GenerationRequest.unsupported` with a message that names them. Responses mirror OpenAI's
objects field for field, plus ``spec_decode``: the request's speculative-decoding statistics.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdecode.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_SAMPLES

MAX_STOP_STRINGS = 16
_REQUEST_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding option; nothing to pad here


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of its constraints."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class PredictedOutput(BaseModel):
    """OpenAI's ``prediction``: text the answer is expected to be close to (the file being
    edited, say), drafted from for free; the answer is the model's whatever it says."""

    model_config = _REQUEST_CONFIG

    type: Literal["content"]
    content: Any  # str | list of text parts, checked like a message's content

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | list[Any]:
        if value is None:
            raise ValueError("prediction.content must be a string or a list of text parts")
        return _text_parts(value)

    def text(self) -> str:
        return _joined(self.content)


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _REQUEST_CONFIG

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; -1 or 0 = off
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generator takes
    stop: tuple[str, ...] = ()
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # vLLM's extension: generate max_tokens even past EOS
    n: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)  # samples of the prompt: choices 0..n-1
    logit_bias: dict[int, float] | None = None  # token id -> bias; JSON keys are the ids as strings
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's extension; 1 = off
    user: str | None = None  # an end-user id for the caller's own logs; changes nothing
    response_format: ResponseFormat | None = None  # OpenAI's on chat; vLLM also takes it on completions
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: json, regex, choice, grammar
    prediction: PredictedOutput | None = None  # OpenAI's predicted outputs (chat; here on completions too)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(value)}")
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return tuple(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        """OpenAI's shape, ``{"50256": -100}``: token ids as decimal strings, biases in [-100, 100]."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError('logit_bias must map token ids to biases, e.g. {"50256": -100}')
        bias: dict[int, float] = {}
        for key, number in value.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
            if token is None:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0 as strings), got {key!r}")
            if not _is_number(number) or not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {number!r} for token {key}")
            bias[token] = float(number)
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first option given that this server cannot honour."""
        checks: list[tuple[str, bool, str]] = [
            ("stream_options", self.stream_options is not None and not self.stream,
             "stream_options is only allowed when stream is true"),
        ]
        checks += self._own_checks()
        for param, given, message in checks:
            if given:
                return param, message
        return None

    def _own_checks(self) -> list[tuple[str, bool, str]]:
        return []

    def constraint(self) -> tuple[str, str, str] | None:
        """(kind, spec, param) of the structured-output constraint asked for, or None; raises
        ValueError naming the field when the request asks for two, or a format without its schema."""
        asked: list[tuple[str, str, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("json_object", "", "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema object with its schema")
            asked.append(("json_schema", json.dumps(fmt.json_schema.schema_), "response_format"))
        so = self.structured_outputs
        if so is not None:
            before = len(asked)
            if so.json_ is not None:
                spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
                asked.append(("json_schema", spec, "structured_outputs.json"))
            if so.regex is not None:
                asked.append(("regex", so.regex, "structured_outputs.regex"))
            if so.choice is not None:
                asked.append(("choice", json.dumps(so.choice), "structured_outputs.choice"))
            if so.grammar is not None:
                asked.append(("grammar", so.grammar, "structured_outputs.grammar"))
            if so.json_object:
                asked.append(("json_object", "", "structured_outputs.json_object"))
            if len(asked) == before:
                raise ValueError("structured_outputs needs one of json, regex, choice, grammar or json_object")
        if len(asked) > 1:
            raise ValueError(f"give one output constraint, not {len(asked)} ({', '.join(a[2] for a in asked)})")
        return asked[0] if asked else None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one raw prompt, text or token ids."""

    prompt: str | list[int]
    best_of: int | None = Field(default=None, ge=1, le=MAX_SAMPLES)  # samples to return the best n of
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        """A string, a list of token ids, or a one-element list of either (OpenAI's batch forms)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of token ids, or a one-element list of those")
        if all(_is_int(t) for t in value):
            return value
        if len(value) > 1:
            raise ValueError("several prompts in one request are not supported: send one request per prompt")
        only = value[0]
        if isinstance(only, str) or (isinstance(only, list) and only and all(_is_int(t) for t in only)):
            return only
        raise ValueError("prompt must be a string, a list of token ids, or a one-element list of those")

    def _own_checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("best_of", self.best_of is not None and self.best_of < (self.n or 1),
             "best_of must be at least n: it is how many samples the n choices are picked from"),
            ("best_of", (self.best_of or 1) > 1 and bool(self.stream),
             "best_of cannot be streamed: the best samples are known only when all have finished"),
            ("echo", bool(self.echo), "echo is not supported"),
            ("logprobs", self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be between 0 and {MAX_LOGPROBS}"),
            ("suffix", bool(self.suffix), "suffix (insertion) is not supported"),
        ]


CHAT_ROLES = ("system", "developer", "user", "assistant")


class ChatMessage(BaseModel):
    """One message in. ``content`` is text or a list of text parts; tool turns are refused."""

    model_config = _REQUEST_CONFIG

    role: str
    content: Any = None  # str | list of text parts; checked below for a clearer message than a union's
    name: str | None = None
    # Fields the openai client echoes back when a reply is appended to the conversation: allowed
    # while empty, refused when they carry something we cannot represent.
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value in ("tool", "function"):
            raise ValueError(f"messages with role '{value}' are not supported: this server does not implement tools")
        if value not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {value!r}")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | list[Any] | None:
        return None if value is None else _text_parts(value)

    def text(self) -> str:
        return _joined(self.content)

    def unsupported(self) -> str | None:
        if self.tool_calls or self.tool_call_id or self.function_call or self.audio:
            return "tool calls and audio in messages are not supported"
        if self.content is None:
            return "content is required (text or a list of text parts)"
        return None

    def for_template(self) -> dict[str, str]:
        """The role/content dict chat templates expect (``developer`` is OpenAI's new ``system``)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # Bookkeeping for OpenAI's platform; nothing to do with the output, accepted and ignored.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _own_checks(self) -> list[tuple[str, bool, str]]:
        checks = [
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs,
             "top_logprobs needs logprobs set to true"),
            ("top_logprobs", self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS,
             f"top_logprobs must be between 0 and {MAX_LOGPROBS}"),
            ("tools", bool(self.tools), "tools are not supported"),
            ("tool_choice", self.tool_choice not in (None, "none"), "tool_choice is not supported"),
            ("functions", bool(self.functions), "functions are not supported"),
            ("function_call", self.function_call not in (None, "none"), "function_call is not supported"),
            ("modalities", self.modalities not in (None, ["text"]), "only the 'text' modality is supported"),
            ("audio", self.audio is not None, "audio output is not supported"),
            ("reasoning_effort", self.reasoning_effort is not None, "reasoning_effort is not supported"),
            ("verbosity", self.verbosity is not None, "verbosity is not supported"),
            ("web_search_options", self.web_search_options is not None, "web search is not supported"),
        ]
        for i, message in enumerate(self.messages):
            problem = message.unsupported()
            checks.append((f"messages.{i}", problem is not None, problem or ""))
        return checks


def _text_parts(value: Any) -> str | list[Any]:
    """A content value as OpenAI sends it: a string or a list of text parts (checked here for a
    clearer message than a union type's)."""
    if not isinstance(value, (str, list)):
        raise ValueError("content must be a string or a list of text parts")
    if isinstance(value, list):
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            if set(part) - {"type", "text"}:
                raise ValueError(f"unknown keys in a content part: {sorted(set(part) - {'type', 'text'})}")
    return value


def _joined(content: str | list[Any] | None) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- responses --------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of the completion tokens: with a prediction, its drafted tokens the
    model kept and refused (the refused ones cost verify rows, never the answer)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose keys and values came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class SpecDecodeStats(BaseModel):
    """The request's speculative-decoding statistics, with vLLM's definitions (see engine/stats.py)."""

    method: str
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    acceptance_rate: float
    accepted_per_position: list[int]


class _ResponseHead(BaseModel):
    """The fields every completion response and stream chunk starts with."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_ResponseHead):
    """Also the shape of each stream chunk (OpenAI uses ``text_completion`` for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    spec_decode: SpecDecodeStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdecode"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
