"""What a request asks of decoding: how to pick tokens (``SamplingParams``) and what the output
must match (``Constraint``).

A leaf module: the sampling layer, the drafters and the engine read these without importing the
engine's settings (``config.py``), which name every drafting method.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from specdecode.errors import InvalidSamplingParamsError

MAX_SPECULATIVE_TOKENS = 32  # verify steps stay below kernels.PREFILL_ROWS rows
# Below this a temperature is greedy decoding in all but name, and dividing float32 logits by it
# overflows (1e-300 is 0 in float32); vLLM draws the same line.
GREEDY_BELOW = 1e-5

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
# Samples of one prompt in one call (``n``, ``best_of``): each decodes as a request of its own
# beside the others, with a KV cache of its own.
MAX_SAMPLES = 16
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's API defines them
MAX_LOGIT_BIAS = 100.0  # a token's bias lies in [-100, 100], as OpenAI's API defines it
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match; ``sample/grammar.py`` compiles it and masks the target with it.

    ``kind``: ``json_object`` (any JSON object; ``spec`` unused), ``json_schema`` (``spec`` is the
    schema as JSON text), ``regex``, ``grammar`` (a Lark grammar; llguidance also reads GBNF
    written as Lark) or ``choice`` (``spec`` is a JSON list of the allowed strings).
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidSamplingParamsError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                                             f"got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidSamplingParamsError(f"a {self.kind} constraint needs its {self.kind.replace('_', ' ')}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (argmax)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the chosen token's logprob and the n most likely
    constraint: Constraint | None = None  # structured output: the grammar the output must match
    # what the output is expected to be close to (OpenAI's predicted outputs, e.g. the file being
    # edited), as text or token ids: drafted from for free; the output stays the target's
    prediction: str | tuple[int, ...] | None = None
    # Penalties and bias on the target's logits (sample/penalties.py): presence and frequency
    # count the generated tokens, repetition the prompt's and the generated ones.
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted from a generated token's logit once per occurrence
    repetition_penalty: float = 1.0  # > 0: a seen token's positive logit divided by it, others multiplied
    # token id -> bias added to its logit; given as a mapping, kept as (id, bias) pairs by id
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a single stop string is a common call shape
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParamsError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidSamplingParamsError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise InvalidSamplingParamsError("stop strings must be non-empty")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidSamplingParamsError(f"seed must be an integer in [-2**63, 2**64 - 1] (what torch's "
                                             f"generator takes), got {str(self.seed)[:40]}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidSamplingParamsError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prediction is not None and not isinstance(self.prediction, str):
            ids = self.prediction
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise InvalidSamplingParamsError("prediction must be text or a list of token ids, got "
                                                 f"{type(ids).__name__}")
            object.__setattr__(self, "prediction", tuple(ids))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidSamplingParamsError("constraint must be a specdecode.Constraint")
        self._check_penalties()
        if self.constraint is not None and self.ignore_eos:
            raise InvalidSamplingParamsError("ignore_eos cannot be combined with a constraint: once the grammar is "
                                             "complete, end of sequence is the only token it allows")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidSamplingParamsError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidSamplingParamsError(f"repetition_penalty must be a number > 0 (1 = off), "
                                             f"got {self.repetition_penalty!r}")
        if self.logit_bias is None:
            return
        bias_map = self.logit_bias
        if not isinstance(bias_map, (Mapping, tuple, list)):
            raise InvalidSamplingParamsError("logit_bias must map token ids to biases, got "
                                             f"{type(bias_map).__name__}")
        pairs = list(bias_map.items()) if isinstance(bias_map, Mapping) else list(bias_map)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise InvalidSamplingParamsError(f"logit_bias must map token ids to biases, got {pair!r}")
            token, bias = pair
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidSamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParamsError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                                                 f"for token {token}")
        ids = [pair[0] for pair in pairs]
        if len(set(ids)) != len(ids):
            raise InvalidSamplingParamsError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)) or None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        """Whether a penalty or a logit bias changes the target's logits (sample/penalties.py)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool): what a penalty or a bias may be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
