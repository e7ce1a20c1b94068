"""Named exceptions for user errors.

Every error a user can cause (bad model name, bad sampling values, a prompt that does not fit)
raises a subclass of :class:`SpecDecodeError` whose message says what to do. The CLI prints the
message on one line and exits with code 2; the server maps them to HTTP 4xx.
"""

from __future__ import annotations


class SpecDecodeError(Exception):
    """Base class of every error caused by user input or the local environment."""


class ModelNotFoundError(SpecDecodeError):
    """The name is neither a catalog entry, a local path, nor a reachable hub id."""


class WeightsMissingError(SpecDecodeError):
    """A known model whose weight files are not installed (e.g. the `models` extra is missing)."""


class HubUnavailableError(SpecDecodeError):
    """A hub id was given but the hub cannot be reached from this machine."""


class UnsupportedModelError(SpecDecodeError):
    """The weights exist but their architecture or quantization is not supported."""


class VocabularyMismatchError(SpecDecodeError):
    """Draft and target do not share a vocabulary, so draft tokens cannot be verified."""


class PromptTooLongError(SpecDecodeError):
    """The prompt (plus at least one new token) does not fit in the model's context."""


class InvalidPromptError(SpecDecodeError, ValueError):
    """The prompt text cannot be tokenized (e.g. it holds a lone UTF-16 surrogate)."""


class InvalidSamplingParamsError(SpecDecodeError, ValueError):
    """A sampling value outside its valid range (negative temperature, top_p outside (0, 1], ...)."""


class InvalidConfigError(SpecDecodeError, ValueError):
    """An engine or speculative-decoding setting outside its valid range."""


class ServerBusyError(SpecDecodeError):
    """The server's wait queue is full; the client should retry later (HTTP 429)."""


class KVCacheFullError(SpecDecodeError):
    """A request's KV cache does not fit the KV memory budget (``kv_cache_memory``) beside the
    running requests' caches (HTTP 503: retry later, or raise the budget)."""


class DatastoreError(SpecDecodeError):
    """A retrieval datastore that is missing, unreadable, built for another tokenizer, or cannot be
    written (or would overwrite an existing store without ``--force``)."""


class NonFiniteLogitsError(SpecDecodeError):
    """The model produced NaN or infinite logits: its weights are damaged (or it overflowed);
    emitting a token from them would pass garbage off as a normal answer."""


class DamagedCacheError(SpecDecodeError):
    """A derived weight file the process maps no longer matches the checksum recorded when it was
    written: decoding would give wrong output, so requests are refused while it is rebuilt."""


class HeadMismatchError(SpecDecodeError):
    """A trained drafter (an EAGLE or Medusa head) made for another target model: its sizes or
    the target fingerprint it recorded differ from the loaded target's."""


class CheckpointError(SpecDecodeError):
    """A head or training checkpoint folder that is missing, incomplete or unreadable."""


class InvalidConstraintError(SpecDecodeError, ValueError):
    """A structured-output constraint that does not compile (a bad JSON schema, regex or grammar)."""


class VocabularyRankingError(SpecDecodeError):
    """A draft-vocabulary ranking that is unreadable, or made for another tokenizer than the draft's."""


class PrefixCacheFileError(SpecDecodeError):
    """A saved prefix cache file that cannot be used: unreadable, truncated, damaged (its checksum
    differs), or made for another model, dtype or build, whose keys and values would not have the
    bits a prefill here computes. Delete it, or let the next save rewrite it."""
