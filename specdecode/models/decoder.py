"""A compact decoder for the Llama family (llama, qwen2, mistral) with a preallocated KV cache.

One class, no per-architecture forks: the family differs only in q/k/v bias, RoPE base and tied
embeddings, all read from :class:`ModelConfig`. Weights are fused (q|k|v, gate|up) so each layer
runs four linear calls. How they run is the decoder's backend (``backends.py``), chosen once when
it is built from the weights' form (float, int8, int4, GGUF) and its role: a target's rows are
batch-invariant (see ``kernels.py``), a draft's take the fastest path.

The model knows nothing else about drafting, nor about sampling: ``forward`` maps tokens at cache slots to
logits, advancing the cache; callers roll it back with ``cache.trim``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specdecode.models.cache import KVCache
from specdecode.errors import InvalidConfigError
from specdecode.models import backends, draft_quant, kernels, vocab_head
from specdecode.models.backends import Backend, Linear, Role
from specdecode.models.config import DTYPES as DTYPE_NAMES, ModelConfig
from specdecode.models.gguf_convert import MARKER_NAME, gguf_sources, write_float_weights
from specdecode.models.gguf_planes import GGUFWeight
from specdecode.models.packed import load_packed
from specdecode.models.weights import DecoderWeights, LayerWeights, Packed

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(slots=True)
class HiddenCapture:
    """Where a forward leaves one sequence's hidden states, for drafters that read them (trained
    heads). ``layers`` are layer indices; the state of layer i is its input (the residual stream
    after layers 0..i-1, Hugging Face's ``hidden_states[i]``), so ``num_layers`` is the final
    layer's output before the norm. Each forward appends [N, len(layers) * D]: every row, even
    with ``last_only``, the layers side by side in the order given."""

    layers: tuple[int, ...]
    _parts: list[Tensor] = field(default_factory=list)

    def take(self) -> Tensor:
        """The rows appended since the last ``take``, in order; then forget them."""
        if not self._parts:
            raise ValueError("no forward has captured hidden states since the last take")
        states = torch.cat(self._parts) if len(self._parts) > 1 else self._parts[0]
        self._parts.clear()
        return states

    def copy_to(self, other: HiddenCapture) -> None:
        """Give ``other`` (a capture of the same layers) the rows appended since the last
        ``take`` as its own: another sample of the same prompt starts on this prefill's states."""
        if other.layers != self.layers:
            raise ValueError(f"captures of layers {self.layers} and {other.layers} cannot share rows")
        other._parts = list(self._parts)  # the tensors are only read, so the samples share them


class Decoder:
    """Llama-family transformer: ``forward(tokens, cache) -> logits``, computed by ``backend``."""

    def __init__(self, config: ModelConfig, weights: DecoderWeights, backend: Backend) -> None:
        """``weights`` in the form ``backend`` computes with (see ``backends.choose``)."""
        self.config = config
        self.backend = backend
        self.dtype = weights.dtype
        self.embed = weights.embed  # [V, D]
        self.lm_head = weights.lm_head  # [V, D]
        self.norm = weights.norm  # [D]
        self.layers = weights.layers
        self.cos, self.sin = weights.cos, weights.sin
        self.vocab_ids: Tensor | None = None  # [N] the token id of each logit column; None: every token

    @classmethod
    def build(cls, config: ModelConfig, packed: Packed, dtype: torch.dtype, role: Role = "target",
              native: bool | None = None, quantize: str | None = None) -> "Decoder":
        """A decoder of ``packed`` (compute-layout tensors as made by ``packed.pack``) in ``role``;
        ``native`` and ``quantize`` choose its backend as ``backends.choose`` says."""
        backend, weights = backends.choose(config, DecoderWeights.from_packed(packed, config, dtype), role, native,
                                           quantize)
        return cls(config, weights, backend)

    @classmethod
    def from_dir(
        cls,
        path: Path | str,
        dtype: str = "float32",
        role: Role = "target",
        native: bool | None = None,
        quantize: str | None = None,
    ) -> "Decoder":
        """Load an HF-format folder (config.json + *.safetensors) through the packed-layout cache;
        with ``quantize="native"``, the GGUF the folder was converted from, as shipped."""
        config = ModelConfig.from_dir(Path(path))
        torch_dtype = DTYPES[dtype]
        if quantize == "native":
            return cls.from_gguf(gguf_sources(Path(path)), config, dtype, role)
        gguf_folder = (Path(path) / MARKER_NAME).is_file()
        if gguf_folder and role == "draft" and quantize in draft_quant.DRAFT_MODES and dtype == "float32":
            # A quantized draft from a GGUF: each matrix dequantized from the GGUF planes just
            # before it is packed, so no float32 copy of the model is written or held whole.
            from specdecode.models import gguf_load

            sources = gguf_sources(Path(path))
            packed = gguf_load.decoder_weights(gguf_load.native_weights(sources), config)
            if quantize == "int4":  # packed once, then mapped (``pack_draft`` keeps a packed weight)
                packed = gguf_load.int4_draft_weights(packed, sources)
            return cls.build(config, packed, torch_dtype, role, native, quantize)
        if gguf_folder:
            write_float_weights(Path(path))
        packed = load_packed(Path(path), config, torch_dtype)
        return cls.build(config, packed, torch_dtype, role, native, quantize)

    @classmethod
    def from_gguf(cls, sources: Sequence[Path], config: ModelConfig, dtype: str = "float32",
                  role: Role = "target", progress: bool = True) -> "Decoder":
        """The GGUF in ``sources`` (a file, or byte parts in order) run natively: its quantized
        matrices through ``kernels.linear_gguf`` (batch-invariant for every row count, prefills
        included), activations and attention in float32."""
        from specdecode.models import gguf_load

        if dtype != "float32":
            raise InvalidConfigError(f"native GGUF weights compute in float32 activations, not {dtype!r}")
        backend = backends.GGUFBackend(role, config.rms_norm_eps)  # its kernels built now, before the load
        packed = gguf_load.decoder_weights(gguf_load.native_weights(sources, progress), config)
        weights = DecoderWeights.from_packed(packed, config, torch.float32)
        return cls(config, weights, backend.rebuilt(config, weights))  # with its native forward

    def with_backend(self, backend: Backend) -> "Decoder":
        """A view of this decoder (every tensor shared) that computes with ``backend``, which must
        take these weights' form: e.g. an int4 draft through its torch layers rather than its
        fused forward, to compare or time the two."""
        view = copy.copy(self)
        view.backend = backend
        return view

    def restrict_vocabulary(self, ids: Tensor) -> "Decoder":
        """A view of this decoder (every other tensor shared) whose logits are the columns ``ids``
        [N] of the full logits, computed from those rows of the LM head only, in the head's own
        form (see ``vocab_head.py``); ``vocab_ids`` maps each column back to its token id.
        ``config.vocab_size`` stays the full vocabulary's, and the embedding stays whole."""
        ids = vocab_head.check_ids(ids, self.config.vocab_size)
        if self.vocab_ids is not None:
            raise InvalidConfigError("this decoder's vocabulary is already restricted; restrict the full decoder")
        weights = DecoderWeights(self.dtype, self.embed, vocab_head.restrict_rows(self.lm_head, ids), self.norm,
                                 self.layers, self.cos, self.sin)
        view = copy.copy(self)
        view.lm_head, view.vocab_ids = weights.lm_head, ids
        view.backend = self.backend.rebuilt(self.config, weights)
        return view

    @property
    def role(self) -> Role:
        return self.backend.role

    def new_cache(self, capacity: int) -> KVCache:
        """A cache for ``capacity`` tokens, rounded up to whole attention key blocks."""
        cfg = self.config
        blocks = math.ceil(capacity / kernels.KEY_BLOCK)
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks * kernels.KEY_BLOCK, self.dtype)

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, tokens: Tensor, cache: KVCache, last_only: bool = False,
                tree: Sequence[int] | None = None, capture: HiddenCapture | None = None,
                invariant: bool = False) -> Tensor:
        """Run ``tokens`` [N] at the next N cache slots; return logits [N, V] (or [1, V]); V is
        ``len(vocab_ids)`` for a restricted vocabulary.

        Row i attends to every cached token and to rows 0..i (causal). The cache length grows by N.
        With ``tree`` (row i's parent row, -1 for row 0), row i attends to the cache and its own
        ancestors instead; see ``forward_batch``. ``capture`` receives the rows' hidden states.
        ``invariant``: every row on the invariant kernels, however many (see ``forward_batch``).
        """
        backend, n = self.backend, tokens.shape[0]
        fused = backend.fused
        if fused is None or tree is not None or capture is not None or (invariant and not backend.fused_invariant) \
                or (n > backend.fused_rows and not backend.fused_chunks):
            return self.forward_batch([(tokens, cache)], last_only, [tree], [capture], invariant)[0]
        # A long input (a prompt, a draft catching up) runs as consecutive chunks of the fused
        # forward's rows, cheaper per token than the weights' many-rows copy (an int4 draft's
        # prefill: docs/PERFORMANCE.md, `scripts/draft_step.py --quantize int4 --rows 150`).
        start, most = cache.reserve(n), backend.fused_rows
        rows = self.embed_tokens(tokens) if isinstance(self.embed, GGUFWeight) else tokens
        chunks = [fused.forward(rows[i : i + most], cache.k, cache.v, start + i, last_only, not last_only or i + most >= n)
                  for i in range(0, n, most)]
        return chunks[-1] if last_only else torch.cat(chunks)

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[tuple[Tensor, KVCache]], last_only: bool = False,
                      trees: Sequence[Sequence[int] | None] | None = None,
                      captures: Sequence[HiddenCapture | None] | None = None, invariant: bool = False) -> list[Tensor]:
        """One forward for several sequences, each ``(tokens [N_i], its own cache)``.

        The rows of all sequences share every linear layer (one pass over the weights, which is
        what a decode step pays for); attention runs per sequence over its own cache. Rows are
        batch-invariant, so each sequence gets the bits it would get alone. Returns logits per
        sequence: [N_i, V], or [1, V] each with ``last_only``.

        ``trees[j]``, when given, makes segment j a token tree: row i's parent row (row 0, the
        root, has -1; parents precede children). A row sits at position start + its depth and
        sees the cache and its ancestors. Attention runs once per root-to-leaf branch, with the
        branch in consecutive slots, so every row computes exactly what it would in a chain: the
        kept path has plain decoding's bits. The cache then holds the rows in node order in its
        side buffers until ``cache.keep_rows`` keeps the accepted path.

        ``captures[j]``, when given, receives segment j's hidden states (see ``HiddenCapture``).

        ``invariant``: a lone long segment (a prompt) stays on the invariant kernels too, so its
        rows get the bits they would get in any other call: what lets a prefill resume after a
        prefix an earlier request computed (``models/prefix_cache.py``).

        A GGUF target runs a batch of chains of up to ``fused_rows`` rows each through its native
        forward (``gguf_forward.py``), which gives every row the layers' bits; an int4 draft runs
        a batch of up to ``fused_batch_rows`` rows in all through its own (``int4_forward.py``).
        """
        trees = trees or [None] * len(segments)
        captures = list(captures or ())
        backend = self.backend
        batched = getattr(backend.fused, "forward_batch", None)  # a native forward of several sequences
        counts = [t.shape[0] for t, _ in segments]
        if batched is not None and len(segments) > 1 and not any(trees) and not any(c is not None for c in captures) \
                and max(counts) <= backend.fused_rows \
                and (backend.fused_batch_rows is None or sum(counts) <= backend.fused_batch_rows):
            starts = [cache.reserve(n) for n, (_, cache) in zip(counts, segments)]
            rows = self.embed_tokens(torch.cat([t for t, _ in segments]))
            logits = batched(rows, [c.k for _, c in segments], [c.v for _, c in segments], starts, counts, last_only)
            return list(logits.split(1 if last_only else counts))
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        views = [self._view(tokens.shape[0], cache, tree, group) for (tokens, cache), tree in zip(segments, trees)]
        tokens = torch.cat([t for t, _ in segments]) if len(segments) > 1 else segments[0][0]
        if len(views) == 1 and views[0].branches is None:  # rows are consecutive positions: a view
            rows = slice(views[0].start, views[0].start + views[0].n)
            cos, sin = self.cos[rows], self.sin[rows]
        else:
            positions = torch.cat([v.positions() for v in views])
            cos, sin = self.cos[positions], self.sin[positions]
        # Only a lone long segment is a prompt prefill, the one call allowed off the invariant path
        # (unless ``invariant``).
        # The decode rows of many sequences stay on the invariant kernel however many they are.
        on_rows = len(segments) != 1 or invariant  # the calls that must keep each row's bits
        linear = self.backend.linear.rows if on_rows else self.backend.linear
        x = self.embed_tokens(tokens)  # [N, D]
        wanted = {i for c in captures if c is not None for i in c.layers}
        last = len(self.layers)
        # With ``last_only`` and no capture of the final states, the last layer's o projection and
        # MLP (most of its weights: about 1/28 of a 1.5B target's prefill) run for the segments'
        # last rows alone: later calls read only the other rows' keys and values. Where the
        # kernel keeps a row's bits in any call (or a draft's, whose bits exactness never reads)
        # the kept rows' logits are what the whole call gives.
        ends = torch.tensor([v.n for v in views]).cumsum(0) - 1 if last_only else None
        kernel = self.backend.linear
        rows_keep_bits = kernel.always or (kernel.invariant and on_rows) or self.backend.role == "draft"
        prune = ends is not None and last > 0 and last not in wanted and rows_keep_bits
        states: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in wanted:
                states[i] = x
            x = self._layer(x, layer, i, views, cos, sin, linear, ends if prune and i == last - 1 else None)
        if last in wanted:
            states[last] = x
        if wanted:
            _deliver(states, captures, [v.n for v in views])
        if ends is not None and not prune:
            x = x[ends]
        logits = self.backend.norm_linear(linear, x, self.norm, self.lm_head).float()
        return list(logits.split(1 if last_only else [v.n for v in views]))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Embedding rows of ``tokens``: a float table indexed, or a GGUF table's rows decoded."""
        return self.embed.rows(tokens) if isinstance(self.embed, GGUFWeight) else self.embed[tokens]

    def _view(self, n: int, cache: KVCache, tree: Sequence[int] | None, group: int) -> _SegmentView:
        start = cache.reserve(n)
        if tree is None or all(p == i - 1 for i, p in enumerate(tree)):
            if not self.backend.chain_keys:
                return _SegmentView(cache, start, n, start + n, None)
            return _SegmentView(cache, start, n, *_chain_keys(start, n, group, self.dtype))
        if len(tree) != n or tree[0] != -1 or any(not 0 <= p < i for i, p in enumerate(tree) if i):
            raise ValueError(f"tree must give each of {n} rows an earlier parent row (-1 for row 0)")
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[tree[i]] + 1
        leaves = sorted(set(range(n)) - set(tree))
        branches = []
        for leaf in leaves:
            path = [leaf]
            while path[-1] != 0:
                path.append(tree[path[-1]])
            path.reverse()
            branches.append((torch.tensor(path), *_chain_keys(start, len(path), group, self.dtype)))
        cache.tree_buffers(start, n)
        return _SegmentView(cache, start, n, 0, None, torch.tensor(depth), branches)

    def _layer(self, x: Tensor, w: LayerWeights, i: int, views: list[_SegmentView], cos: Tensor, sin: Tensor,
               linear: Linear, keep: Tensor | None = None) -> Tensor:
        """One decoder layer over ``x``'s rows; with ``keep``, only those rows leave it (every
        row's keys and values are still written to the cache)."""
        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        scale = 1.0 / math.sqrt(d)
        steps = self.backend
        qkv = steps.norm_linear(linear, x, w.in_norm, w.qkv)
        q, k, v = steps.rope(qkv, w.qkv_bias, cos, sin, hq, hkv)
        outs, row = [], 0
        for seg in views:
            rows = slice(row, row + seg.n)
            row += seg.n
            if seg.branches is None:
                outs.append(steps.attend(q[rows], k[rows], v[rows], seg.cache, i, seg.start, seg.span, seg.bias,
                                         scale))
                continue
            node_k, node_v = seg.cache.node_k, seg.cache.node_v
            node_k[i, :, : seg.n] = k[rows].transpose(0, 1)
            node_v[i, :, : seg.n] = v[rows].transpose(0, 1)
            out = q.new_empty(seg.n, hq * d)
            for path, span, bias in seg.branches:  # each branch in the slots after the cache
                out[path] = steps.attend_branch(q[rows][path], k[rows][path], v[rows][path], seg.cache, i,
                                                seg.start, span, bias, scale)
            outs.append(out)
        attn = torch.cat(outs) if len(outs) > 1 else outs[0]
        if keep is not None:
            attn, x = attn[keep].contiguous(), x[keep].contiguous()
        x = steps.linear_add(linear, attn, w.o, x)
        gate_up = steps.norm_linear(linear, x, w.post_norm, w.gate_up)
        return steps.glu_linear_add(linear, gate_up, w.down, x)


@dataclass(slots=True)
class _SegmentView:
    """Where one sequence's rows of a batched forward go: its cache, first slot, row count, the
    keys its attention reads (whole blocks) and its causal mask; for a tree, each row's depth and
    each root-to-leaf branch (its rows, key span and causal mask)."""

    cache: KVCache
    start: int
    n: int
    span: int
    bias: Tensor | None
    depth: Tensor | None = None  # [N] for a tree
    branches: list[tuple[Tensor, int, Tensor]] | None = None

    def positions(self) -> Tensor:
        offsets = torch.arange(self.n) if self.depth is None else self.depth
        return self.start + offsets


def _deliver(states: dict[int, Tensor], captures: Sequence[HiddenCapture | None], sizes: list[int]) -> None:
    """Hand each sequence its rows of the captured layers' states."""
    for j, capture in enumerate(captures):
        if capture is not None:
            whole = torch.cat([states[i].float() for i in capture.layers], dim=-1)
            capture._parts.append(whole.split(sizes)[j] if len(sizes) > 1 else whole)


def _chain_keys(start: int, n: int, group: int, dtype: torch.dtype) -> tuple[int, Tensor]:
    """Key span (whole blocks) and causal mask for ``n`` consecutive rows from slot ``start``."""
    span = math.ceil((start + n) / kernels.KEY_BLOCK) * kernels.KEY_BLOCK
    return span, _causal_bias(start, n, span, group).to(dtype)  # [G*N, span]


def _causal_bias(start: int, n: int, span: int, group: int) -> Tensor:
    """Additive mask [G*N, span]: row (g, i) sees slots 0 .. start+i."""
    cols = torch.arange(span)
    visible = cols[None, :] <= (start + torch.arange(n))[:, None]  # [N, span]
    bias = torch.zeros(n, span).masked_fill_(~visible, float("-inf"))
    return bias.repeat(group, 1)
