"""Automatic prefix caching: a finished request's KV cache serves the next request that starts
with the same tokens, and every request's cache lives inside one memory budget.

Chat clients and agents resend the whole conversation each turn; without a cache every turn
prefills all of it again (on a CPU, tens of seconds for a long conversation). Here a request that
ends hands its cache back together with the token ids the cache holds; a new request takes the
entry sharing the longest token prefix with its prompt, keeps ``min(common, len(prompt) - 1)``
tokens of it (at least one prompt token must run, so the prefill yields the first token's
logits) and prefills only the rest.

Exactness: the engine prefills through the target's row-invariant kernels (``Batch``), so a row's
keys and values do not depend on which rows were computed with it: a cached prefix, resumed,
gives bitwise the logits a prefill of the whole prompt gives (tests/test_prefix_cache.py).

Ownership: an entry in use belongs to its request alone. A request that extends an entry takes
it out of the pool (its cache is reused in place); a request that shares only part of an entry
(a branch: the same system prompt, another question) gets a copy of the shared part, so the
entry still serves its own conversation. A copy is also made when the entry's cache is smaller
than the request needs.

Memory: every cache, running or idle, counts against ``budget`` bytes. Allocating evicts idle
entries least recently used first; running requests' caches are never evicted. A request that
cannot fit even then gets ``KVCacheFullError`` instead of an out-of-memory crash. A kept cache
much larger than the tokens it holds is first copied into one of their size (whole blocks). With
``enabled=False`` nothing is kept or looked up, but the budget still bounds the running caches.

Disk: ``save`` and ``load`` carry the idle entries to a file and into a later process (a long
system prompt or document prefilled once, not at every start), checked against what their bits
depend on (``prefix_file``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdecode.errors import InvalidConfigError, KVCacheFullError
from specdecode.models.cache import KVCache

# The default budget's share of the machine's memory: the weights (about 1.1 GB for the default
# pair), the OS and the rest of the process need the remainder, and a quarter of 24 GiB holds
# about 100k tokens of the 1.5B target's keys and values (56 KiB a token).
DEFAULT_MEMORY_SHARE = 0.25
FALLBACK_MEMORY = 4 << 30  # where the machine's memory cannot be read

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str | int) -> int:
    """Bytes from ``text``: a number with an optional unit (``2GiB``, ``512MiB``, ``1.5GB``, ``1e9``)."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidConfigError(f"KV cache memory {text!r} is not a size; write e.g. 2GiB, 512MiB or 1500000000")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InvalidConfigError(f"KV cache memory must be positive, got {text!r}")
    return value


def default_memory() -> int:
    """``DEFAULT_MEMORY_SHARE`` of the machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return FALLBACK_MEMORY
    return int(total * DEFAULT_MEMORY_SHARE)


def companion(pool: PrefixCache, new_cache: Callable[[int], KVCache]) -> PrefixCache:
    """A prefix cache for a second model over the same sequences (a draft model's), given its
    share of ``pool``'s budget: a sequence is kept by both, so they split the budget in
    proportion to their bytes per token."""
    other = PrefixCache(new_cache, 1, pool.enabled)
    total = pool.budget
    other.budget = max(1, total * other.slot_bytes // (pool.slot_bytes + other.slot_bytes))
    pool.budget = total - other.budget
    return other


def common_prefix(a: Tensor, b: Tensor) -> int:
    """How many leading tokens the id tensors ``a`` and ``b`` share."""
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.shape[0] else n


def starts_with(ids: Tensor, prefix: Tensor) -> bool:
    """Whether the id tensor ``ids`` begins with all of ``prefix``: ``common_prefix(prefix, ids)
    == len(prefix)``, in a fifth of the time (one comparison, no index search)."""
    n = prefix.shape[0]
    return n <= ids.shape[0] and torch.equal(ids[:n], prefix)


@dataclass(eq=False, slots=True)
class _Entry:
    """An idle cache and the token ids its first ``len(ids)`` slots hold."""

    ids: Tensor  # [L] int64
    cache: KVCache


@dataclass(frozen=True, slots=True)
class Lease:
    """A cache handed to one request: its first ``cached`` slots already hold the prompt's first
    ``cached`` tokens (0: an empty cache)."""

    cache: KVCache
    cached: int


class PrefixCache:
    """The pool of idle caches and the budget of all caches; see the module docstring.

    ``new_cache(capacity)``: a zeroed cache for at least ``capacity`` tokens (``Decoder.new_cache``,
    which rounds capacities up to whole blocks). Counters, in vLLM's units: ``queries`` prompt
    tokens looked up, ``hits`` of them found cached, ``evictions`` entries evicted.
    """

    def __init__(self, new_cache: Callable[[int], KVCache], budget: int, enabled: bool = True) -> None:
        self.new_cache, self.budget, self.enabled = new_cache, budget, enabled
        probe = new_cache(1)
        self.block = probe.capacity
        self.slot_bytes = _bytes(probe) // probe.capacity
        self._idle: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # least recent first
        self._leased: dict[int, int] = {}  # id(cache) -> its bytes, for caches requests hold
        self.used = 0  # bytes of every cache counted here, running or idle
        self.queries = self.hits = self.evictions = 0
        # A server's worker thread and direct ``LLM`` calls may share one engine.
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, prompt_ids: Sequence[int], capacity: int, reuse: bool = True) -> Lease:
        """A cache of at least ``capacity`` tokens for a request with ``prompt_ids``, holding the
        longest cached prefix of them (``reuse`` False: an empty one, for requests that need
        every prompt row computed). Raises ``KVCacheFullError`` when it cannot fit."""
        with self._lock:
            return self._take(prompt_ids, capacity, reuse)

    def _take(self, prompt_ids: Sequence[int], capacity: int, reuse: bool) -> Lease:
        prompt = torch.tensor(list(prompt_ids), dtype=torch.long)
        entry, keep = None, 0
        if self.enabled and reuse:
            self.queries += prompt.shape[0]
            entry, common = self._longest(prompt)
            keep = min(common, prompt.shape[0] - 1)
        if entry is None or keep == 0:
            return Lease(self._allocate(capacity), 0)
        held = entry.ids.shape[0]
        if entry.cache.capacity >= capacity and keep >= held - keep:  # extends it: take it whole
            self.hits += keep
            del self._idle[id(entry)]
            self._leased[id(entry.cache)] = _bytes(entry.cache)
            entry.cache.length = keep
            return Lease(entry.cache, keep)
        superseded = keep == held  # the copy holds all the entry holds: it can go after the copy
        try:
            cache = self._allocate(capacity, pinned=entry, frees=_bytes(entry.cache) if superseded else 0)
        except KVCacheFullError:  # no room beside the entry to copy from: start cold, evicting it too
            return Lease(self._allocate(capacity), 0)
        self.hits += keep
        cache.copy_prefix(entry.cache, keep)
        if superseded:
            self._drop(entry)
        else:
            self._idle.move_to_end(id(entry))
        return Lease(cache, keep)

    def release(self, cache: KVCache, token_ids: Sequence[int]) -> None:
        """A request ended with ``cache``, whose first slots hold ``token_ids`` (as many as the
        cache's length): keep it for later requests, or free it when caching is off. Caches not
        taken from here are ignored."""
        with self._lock:
            self._release(cache, token_ids)

    def _release(self, cache: KVCache, token_ids: Sequence[int]) -> None:
        size = self._leased.pop(id(cache), None)
        if size is None:
            return
        self.used -= size
        held = min(cache.length, len(token_ids))
        if self.enabled and held:
            cache.length = held
            kept = self._compact(cache, held)
            self.used += _bytes(kept)
            self._keep(token_ids[:held], kept)

    def restore(self, prompt_ids: Sequence[int], cache: KVCache) -> int:
        """Copy the longest cached prefix of ``prompt_ids`` (all but its last token at most) into
        ``cache``, which the caller owns (a draft model's cache); return how many tokens it now
        holds (0: none, the cache emptied)."""
        with self._lock:
            cache.length = 0
            if not self.enabled:
                return 0
            prompt = torch.tensor(list(prompt_ids), dtype=torch.long)
            self.queries += prompt.shape[0]
            entry, common = self._longest(prompt)
            keep = min(common, prompt.shape[0] - 1, cache.capacity)
            if entry is None or keep <= 0:
                return 0
            self.hits += keep
            cache.copy_prefix(entry.cache, keep)
            self._idle.move_to_end(id(entry))
            return keep

    def keep_copy(self, cache: KVCache, token_ids: Sequence[int]) -> None:
        """Keep a copy of ``cache``'s first slots, which hold ``token_ids``, for ``restore``; the
        caller keeps ``cache``. Skipped when the copy does not fit the budget even with every
        idle entry evicted: a draft's cache only saves time."""
        with self._lock:
            held = min(cache.length, len(token_ids))
            if not self.enabled or not held:
                return
            try:
                self._make_room(self._blocks(held) * self.slot_bytes)
            except KVCacheFullError:
                return
            copy = self._copy(cache, held, self._blocks(held))
            self.used += _bytes(copy)
            self._keep(token_ids[:held], copy)

    def save(self, path: str | os.PathLike, identity: dict[str, Any], part: str = "target") -> int:
        """Write the idle entries to ``path`` as ``part`` of a prefix cache file, under ``identity``
        (what their bits depend on: ``prefix_file.model_identity``); returns the tokens written."""
        from specdecode.models import prefix_file

        return prefix_file.save(Path(path), {part: prefix_file.Pool(self, identity)})[part]

    def load(self, path: str | os.PathLike, identity: dict[str, Any], part: str = "target") -> int:
        """Restore ``part`` of the file at ``path`` when it was saved under an equal ``identity``;
        returns the tokens restored. Raises ``PrefixCacheFileError`` on a mismatch or damage."""
        from specdecode.models import prefix_file

        return prefix_file.load(Path(path), {part: prefix_file.Pool(self, identity)})[part]

    def layout(self) -> dict[str, Any]:
        """The shape and dtype of a kept token's keys and values, part of a saved entry's identity."""
        probe = self.new_cache(1)
        layers, heads, _, dim = probe.k.shape
        return {"kv_layers": layers, "kv_heads": heads, "head_dim": dim, "kv_dtype": str(probe.k.dtype)}

    @contextlib.contextmanager
    def frozen(self) -> Iterator[list[tuple[Tensor, Tensor, Tensor]]]:
        """Every idle entry, least recently used first: its ids [L] and the keys and values of its
        ``L`` slots, [layers, kv_heads, L, head_dim] each. Views, so the pool stays locked while
        the block reads them (a request taking an entry would write into it); requests that start
        or end meanwhile wait."""
        with self._lock:
            yield [(e.ids, e.cache.k[:, :, : e.ids.shape[0]], e.cache.v[:, :, : e.ids.shape[0]])
                   for e in self._idle.values()]

    def adopt(self, entries: Iterable[tuple[Tensor, Tensor, Tensor]]) -> int:
        """Keep ``entries`` (as ``frozen`` gives them, least recently used first) as idle
        entries, evicting older ones to make room; an entry that does not fit even so is skipped.
        Counts no hit: a hit is a request's. Returns the tokens of those still kept at the end."""
        with self._lock:
            if not self.enabled:
                return 0
            kept = []
            for ids, k, v in entries:
                held = ids.shape[0]
                need = self._blocks(held) * self.slot_bytes
                if need > self.budget:  # would evict everything, then not fit
                    continue
                try:
                    self._make_room(need)
                except KVCacheFullError:  # running requests hold the room
                    continue
                cache = self.new_cache(held)
                cache.k[:, :, :held], cache.v[:, :, :held], cache.length = k, v, held
                self.used += _bytes(cache)
                kept.append(self._keep(ids.tolist(), cache))
            return sum(e.ids.shape[0] for e in kept if id(e) in self._idle)

    def _keep(self, token_ids: Sequence[int], cache: KVCache) -> _Entry:
        """Add an idle entry (its bytes already counted), dropping the entries it extends."""
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        for old in [e for e in self._idle.values() if starts_with(ids, e.ids)]:
            self._drop(old)  # the new entry serves every prompt the old one would, as far or further
        entry = _Entry(ids, cache)
        self._idle[id(entry)] = entry
        return entry

    def discard(self, cache: KVCache) -> None:
        """Free a taken cache without keeping it (its request failed mid-forward)."""
        with self._lock:
            size = self._leased.pop(id(cache), None)
            if size is not None:
                self.used -= size

    def clear(self) -> None:
        """Forget every idle entry (running requests keep theirs)."""
        with self._lock:
            for entry in list(self._idle.values()):
                self._drop(entry)

    def _longest(self, prompt: Tensor) -> tuple[_Entry | None, int]:
        best, best_common = None, 0
        for entry in self._idle.values():
            common = common_prefix(entry.ids, prompt)
            if common > best_common:
                best, best_common = entry, common
        return best, best_common

    def _allocate(self, capacity: int, pinned: _Entry | None = None, frees: int = 0) -> KVCache:
        """A new leased cache; see ``_make_room``."""
        self._make_room(self._blocks(capacity) * self.slot_bytes, pinned, frees)
        cache = self.new_cache(capacity)
        size = _bytes(cache)
        self._leased[id(cache)] = size
        self.used += size
        return cache

    def _make_room(self, need: int, pinned: _Entry | None = None, frees: int = 0) -> None:
        """Evict idle entries (least recently used first, never ``pinned``) until ``need`` more
        bytes fit; ``frees``: bytes the caller frees right after (a superseded entry)."""
        while self.used - frees + need > self.budget:
            victim = next((e for e in self._idle.values() if e is not pinned), None)
            if victim is None:
                raise KVCacheFullError(self._full_message(need))
            self._drop(victim)
            self.evictions += 1

    def _blocks(self, tokens: int) -> int:
        """Slots a cache for ``tokens`` tokens has (whole blocks)."""
        return math.ceil(tokens / self.block) * self.block

    def _copy(self, cache: KVCache, held: int, capacity: int) -> KVCache:
        copy = self.new_cache(capacity)
        copy.copy_prefix(cache, held)
        return copy

    def _compact(self, cache: KVCache, held: int) -> KVCache:
        """``cache``, or a copy of its ``held`` tokens in a cache of whole blocks when that frees
        at least half of it: a request's cache is sized for its prompt and ``max_tokens`` (a chat
        request's, for the whole context), far more than an answer that stopped early leaves."""
        blocks = self._blocks(held)
        return cache if 2 * blocks > cache.capacity else self._copy(cache, held, blocks)

    def _drop(self, entry: _Entry) -> None:
        del self._idle[id(entry)]
        self.used -= _bytes(entry.cache)

    def _full_message(self, need: int) -> str:
        if need > self.budget:
            return (f"this request's KV cache needs {_size(need)}, more than the whole KV cache budget of "
                    f"{_size(self.budget)}; lower max_tokens or the prompt, or raise --kv-cache-memory")
        return (f"this request's KV cache needs {_size(need)} but running requests hold "
                f"{_size(self.used)} of the {_size(self.budget)} KV cache budget; retry shortly, "
                "or raise --kv-cache-memory")


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point: 1.5 GiB, 96.0 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _bytes(cache: KVCache) -> int:
    return cache.k.nbytes + cache.v.nbytes
