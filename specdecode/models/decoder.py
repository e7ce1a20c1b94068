"""A compact decoder for the Llama family (llama, qwen2, mistral) with a preallocated KV cache.

One class, no per-architecture forks: the family differs only in q/k/v bias, RoPE base and tied
embeddings, all read from :class:`ModelConfig`. Weights are fused (q|k|v, gate|up) so each layer
runs four linear calls, through kernels whose rows are batch-invariant (see ``kernels.py``).

The model knows nothing about drafting or sampling: ``forward`` maps tokens at cache slots to
logits, advancing the cache; callers roll it back with ``cache.trim``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from specdecode.models.cache import KVCache
from specdecode.errors import InvalidConfigError
from specdecode.models import draft_quant, kernels
from specdecode.models.config import ModelConfig
from specdecode.models.gguf_convert import MARKER_NAME, write_float_weights
from specdecode.models.gguf_native import GGUFLinear, GGUFWeight, gguf_sources
from specdecode.models.int4_forward import fused_int4_draft
from specdecode.models.int8_rows import QUANTIZE_MODES, quantize_rows
from specdecode.models.packed import load_packed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


@dataclass(slots=True)
class LayerWeights:
    in_norm: Tensor  # [D]
    qkv: Tensor  # [(H + 2*Hkv) * d, D]; the four projections may be prepacked int8 (draft_quant.py)
    qkv_bias: Tensor | None  # [(H + 2*Hkv) * d]
    o: Tensor  # [D, H*d]
    post_norm: Tensor  # [D]
    gate_up: Tensor  # [2*I, D]
    down: Tensor  # [D, I]


class Decoder:
    """Llama-family transformer: ``forward(tokens, cache) -> logits``."""

    def __init__(
        self,
        config: ModelConfig,
        packed: dict[str, Tensor],
        dtype: torch.dtype,
        batch_invariant: bool = True,
        native: bool | None = None,
        quantize: str | None = None,
    ) -> None:
        """``packed``: compute-layout tensors as made by ``packed.pack``; ``native``: use the
        compiled kernel (None = when available), False forces the portable torch path;
        ``quantize="int8"``: int8 linear weights, per-row int8 with float activations for a
        batch-invariant model (a target), fbgemm's dynamic int8 for a draft (see ``draft_quant.py``)."""
        self.config = config
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self._linear = _pick_linear(dtype, batch_invariant, native)
        self.embed = packed["embed"]  # [V, D]
        self.lm_head = packed.get("lm_head", self.embed)  # [V, D]
        self.norm = packed["norm"]  # [D]
        self.layers = [
            LayerWeights(**{f: packed.get(f"layers.{i}.{f}") for f in LayerWeights.__slots__})
            for i in range(config.num_layers)
        ]
        cos, sin = kernels.rope_tables(
            config.head_dim, config.rope_theta, config.max_position_embeddings + kernels.KEY_BLOCK
        )
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)  # HF also rotates in the model dtype
        self._fused = None  # an int4 draft's whole decode-row forward in one native call
        self._attend = _attend  # native GGUF models: _attend_rows
        self._steps: _TorchSteps | _GGUFSteps = _TorchSteps(
            kernels.rms_norm if batch_invariant else kernels.rms_norm_fast, config.rms_norm_eps)
        if quantize is not None:
            self._quantize(quantize)

    @classmethod
    def from_dir(
        cls,
        path: Path | str,
        dtype: str = "float32",
        batch_invariant: bool = True,
        native: bool | None = None,
        quantize: str | None = None,
    ) -> "Decoder":
        """Load an HF-format folder (config.json + *.safetensors) through the packed-layout cache;
        with ``quantize="native"``, the GGUF the folder was converted from, as shipped."""
        config = ModelConfig.from_dir(Path(path))
        torch_dtype = DTYPES[dtype]
        if quantize == "native":
            return cls.from_gguf(gguf_sources(Path(path)), config, dtype, batch_invariant)
        gguf_folder = (Path(path) / MARKER_NAME).is_file()
        if gguf_folder and not batch_invariant and quantize in draft_quant.DRAFT_MODES and dtype == "float32":
            # A quantized draft from a GGUF: each matrix dequantized from the GGUF planes just
            # before it is packed, so no float32 copy of the model is written or held whole.
            from specdecode.models import gguf_load

            packed = gguf_load.decoder_weights(gguf_load.native_weights(gguf_sources(Path(path))), config)
            return cls(config, packed, torch_dtype, batch_invariant, native, quantize)
        if gguf_folder:
            write_float_weights(Path(path))
        packed = load_packed(Path(path), config, torch_dtype)
        return cls(config, packed, torch_dtype, batch_invariant, native, quantize)

    @classmethod
    def from_gguf(cls, sources: Sequence[Path], config: ModelConfig, dtype: str = "float32",
                  batch_invariant: bool = True, progress: bool = True) -> "Decoder":
        """The GGUF in ``sources`` (a file, or byte parts in order) run natively: its quantized
        matrices through ``kernels.linear_gguf`` (batch-invariant for every row count, prefills
        included), activations and attention in float32."""
        from specdecode.models import gguf_load, native

        if dtype != "float32":
            raise InvalidConfigError(f"native GGUF weights compute in float32 activations, not {dtype!r}")
        native.load_gguf()  # built (or refused, by name) now rather than at the first forward
        native.load_attention()
        packed = gguf_load.decoder_weights(gguf_load.native_weights(sources, progress), config)
        model = cls(config, packed, torch.float32, batch_invariant)
        model._linear = kernels.LinearKernel(kernels.linear_gguf, invariant=True)
        model._attend = _attend_rows
        model._steps = _GGUFSteps(config.rms_norm_eps)
        return model

    def _quantize(self, mode: str) -> None:
        """int8 (or, for a draft, int4) weights. A batch-invariant model (a target) gets per-row
        int8 weights with float activations, whose rows stay invariant; a draft gets fbgemm's
        faster dynamic int8, or int4 weights for its decode rows (``draft_quant.Int4Groups``)."""
        modes = QUANTIZE_MODES if self.batch_invariant else draft_quant.DRAFT_MODES
        if mode not in modes or self.dtype != torch.float32:
            raise InvalidConfigError(f"quantize must be one of {modes} with float32, got {mode!r}")
        if self.batch_invariant:
            self.lm_head = quantize_rows(self.lm_head)
            for w in self.layers:
                w.qkv, w.o = quantize_rows(w.qkv), quantize_rows(w.o)
                w.gate_up, w.down = quantize_rows(w.gate_up), quantize_rows(w.down)
            self._linear = kernels.LinearKernel(kernels.linear_int8_invariant, invariant=True)
            return
        packer = draft_quant.pack_int4 if mode == "int4" else draft_quant.pack_int8

        def pack(w: Tensor | GGUFLinear) -> object:
            if isinstance(w, GGUFLinear):
                return draft_quant.pack_int4(w.dequantize(), many_rows=w) if mode == "int4" else packer(w.dequantize())
            # Calls of many rows (the prompt's prefill) keep float activations on per-row int8
            # weights: fbgemm's one activation scale per call lets one row's outliers blur the rest.
            return draft_quant.pack_int4(w, many_rows=quantize_rows(w)) if mode == "int4" else packer(w)

        self.lm_head = pack(self.lm_head)
        for w in self.layers:
            w.qkv, w.o = pack(w.qkv), pack(w.o)
            w.gate_up, w.down = pack(w.gate_up), pack(w.down)
        self._linear = kernels.LinearKernel(draft_quant.linear_draft, invariant=False)
        self._fused = fused_int4_draft(self)

    def new_cache(self, capacity: int) -> KVCache:
        """A cache for ``capacity`` tokens, rounded up to whole attention key blocks."""
        cfg = self.config
        blocks = math.ceil(capacity / kernels.KEY_BLOCK)
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks * kernels.KEY_BLOCK, self.dtype)

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, tokens: Tensor, cache: KVCache, last_only: bool = False,
                tree: Sequence[int] | None = None, capture: HiddenCapture | None = None) -> Tensor:
        """Run ``tokens`` [N] at the next N cache slots; return logits [N, V] (or [1, V]).

        Row i attends to every cached token and to rows 0..i (causal). The cache length grows by N.
        With ``tree`` (row i's parent row, -1 for row 0), row i attends to the cache and its own
        ancestors instead; see ``forward_batch``. ``capture`` receives the rows' hidden states.
        """
        if self._fused is not None and tree is None and capture is None and tokens.shape[0] <= draft_quant.INT4_MAX_ROWS:
            start = cache.reserve(tokens.shape[0])
            rows = self.embed_tokens(tokens) if isinstance(self.embed, GGUFWeight) else tokens
            return self._fused.forward(rows, cache.k, cache.v, start, last_only)
        return self.forward_batch([(tokens, cache)], last_only, [tree], [capture])[0]

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[tuple[Tensor, KVCache]], last_only: bool = False,
                      trees: Sequence[Sequence[int] | None] | None = None,
                      captures: Sequence[HiddenCapture | None] | None = None) -> list[Tensor]:
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
        """
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        trees = trees or [None] * len(segments)
        views = [self._view(tokens.shape[0], cache, tree, group) for (tokens, cache), tree in zip(segments, trees)]
        tokens = torch.cat([t for t, _ in segments]) if len(segments) > 1 else segments[0][0]
        if len(views) == 1 and views[0].branches is None:  # rows are consecutive positions: a view
            rows = slice(views[0].start, views[0].start + views[0].n)
            cos, sin = self.cos[rows], self.sin[rows]
        else:
            positions = torch.cat([v.positions() for v in views])
            cos, sin = self.cos[positions], self.sin[positions]
        # Only a lone long segment is a prompt prefill, the one call allowed off the invariant path.
        # The decode rows of many sequences stay on the invariant kernel however many they are.
        linear = self._linear if len(segments) == 1 else self._linear.rows
        x = self.embed_tokens(tokens)  # [N, D]
        captures = list(captures or ())
        wanted = {i for c in captures if c is not None for i in c.layers}
        states: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in wanted:
                states[i] = x
            x = self._layer(x, layer, i, views, cos, sin, linear)
        if len(self.layers) in wanted:
            states[len(self.layers)] = x
        if wanted:
            _deliver(states, captures, [v.n for v in views])
        if last_only:
            ends = torch.tensor([v.n for v in views]).cumsum(0) - 1
            x = x[ends]
        logits = self._steps.norm_linear(linear, x, self.norm, self.lm_head).float()
        return list(logits.split(1 if last_only else [v.n for v in views]))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Embedding rows of ``tokens``: a float table indexed, or a GGUF table's rows decoded."""
        return self.embed.rows(tokens) if isinstance(self.embed, GGUFWeight) else self.embed[tokens]

    def _view(self, n: int, cache: KVCache, tree: Sequence[int] | None, group: int) -> _SegmentView:
        start = cache.reserve(n)
        if tree is None or all(p == i - 1 for i, p in enumerate(tree)):
            if not self.batch_invariant or self._attend is _attend_rows:  # these need no key span or mask
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

    def _layer(self, x, w: LayerWeights, i: int, views: list[_SegmentView], cos, sin, linear) -> Tensor:
        cfg = self.config
        n, hq, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        scale = 1.0 / math.sqrt(d)
        steps = self._steps
        qkv = steps.norm_linear(linear, x, w.in_norm, w.qkv)
        q, k, v = steps.rope(qkv, w.qkv_bias, cos, sin, hq, hkv)
        outs, row = [], 0
        for seg in views:
            rows = slice(row, row + seg.n)
            row += seg.n
            if seg.branches is None and not self.batch_invariant:
                outs.append(_attend_fast(q[rows], k[rows], v[rows], seg.cache, i, seg.start, scale))
                continue
            if seg.branches is None:
                outs.append(self._attend(q[rows], k[rows], v[rows], seg.cache, i, seg.start, seg.span, seg.bias,
                                         scale))
                continue
            node_k, node_v = seg.cache.node_k, seg.cache.node_v
            node_k[i, :, : seg.n] = k[rows].transpose(0, 1)
            node_v[i, :, : seg.n] = v[rows].transpose(0, 1)
            out = q.new_empty(seg.n, hq * d)
            for path, span, bias in seg.branches:  # each branch in the slots after the cache
                out[path] = self._attend(q[rows][path], k[rows][path], v[rows][path], seg.cache, i, seg.start,
                                         span, bias, scale)
            outs.append(out)
        attn = torch.cat(outs) if len(outs) > 1 else outs[0]
        x = steps.linear_add(linear, attn, w.o, x)
        gate_up = steps.norm_linear(linear, x, w.post_norm, w.gate_up)
        return steps.glu_linear_add(linear, gate_up, w.down, x)


class _TorchSteps:
    """A layer's steps around its matrix products, as torch ops: RMS norm then ``linear``; a
    residual add; silu(gate) * up then ``linear``."""

    def __init__(self, rms_norm, eps: float) -> None:
        self.rms_norm, self.eps = rms_norm, eps

    def norm_linear(self, linear, x: Tensor, norm: Tensor, w) -> Tensor:
        return linear(self.rms_norm(x, norm, self.eps), w)

    def linear_add(self, linear, x: Tensor, w, residual: Tensor) -> Tensor:
        return residual + linear(x, w)

    def glu_linear_add(self, linear, gate_up: Tensor, w, residual: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + linear(torch.nn.functional.silu(gate) * up, w)

    def rope(self, qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, hq: int,
             hkv: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [N, heads, d] of a fused q|k|v: bias added, RoPE on q and k."""
        if bias is not None:
            qkv = qkv + bias
        n, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        q = kernels.apply_rope(q.view(n, hq, d), cos, sin)
        k = kernels.apply_rope(k.view(n, hkv, d), cos, sin)
        return q, k, v.view(n, hkv, d)


class _GGUFSteps:
    """The same steps for native GGUF models, each one call of the GGUF kernel with the norm,
    the gated activation or the residual add fused in (``kernels.linear_gguf``): a decode step
    of the 1.5B target made some 200 small torch calls for them."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def norm_linear(self, linear, x: Tensor, norm: Tensor, w) -> Tensor:
        return kernels.linear_gguf(x, w, norm=norm, eps=self.eps)

    def linear_add(self, linear, x: Tensor, w, residual: Tensor) -> Tensor:
        return kernels.linear_gguf(x, w, residual=residual.contiguous())

    def glu_linear_add(self, linear, gate_up: Tensor, w, residual: Tensor) -> Tensor:
        return kernels.linear_gguf(gate_up, w, glu=True, residual=residual.contiguous())

    def rope(self, qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, hq: int,
             hkv: int) -> tuple[Tensor, Tensor, Tensor]:
        n, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
        q, k, v = kernels.rope_qkv(qkv, bias, cos, sin, hq, hkv).split((hq * d, hkv * d, hkv * d), dim=-1)
        return q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)


def _attend(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int, span: int,
            bias: Tensor, scale: float) -> Tensor:
    """Write a chain of rows' keys and values at slots ``start..`` of ``layer`` and attend over
    the cache up to them: q [N, Hq, d], k/v [N, Hkv, d] -> [N, Hq*d]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    cache.k[layer, :, start : start + n] = k.transpose(0, 1)
    cache.v[layer, :, start : start + n] = v.transpose(0, 1)
    # [N, Hq, d] -> [Hkv, G*N, d]: query heads of one kv head are consecutive in HF layouts.
    qg = q.reshape(n, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)
    attn = kernels.attention(qg, cache.k[layer, :, :span], cache.v[layer, :, :span], bias, scale)
    return attn.view(hkv, hq // hkv, n, d).permute(2, 0, 1, 3).reshape(n, hq * d)


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int, span: int,
                 bias: Tensor, scale: float) -> Tensor:
    """``_attend`` through the row-wise native kernel (``kernels.attention_rows``), which needs no
    key span or mask: each row's causal window follows from its slot."""
    n = q.shape[0]
    cache.k[layer, :, start : start + n] = k.transpose(0, 1)
    cache.v[layer, :, start : start + n] = v.transpose(0, 1)
    return kernels.attention_rows(q, cache.k[layer], cache.v[layer], start, scale)


def _attend_fast(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int,
                 scale: float) -> Tensor:
    """``_attend`` through one fused SDPA call, for models whose rows need not be batch-invariant
    (drafts: the target verifies every token they propose). Their steps are a few milliseconds,
    so the invariant path's dozen small ops per layer are a large share of them."""
    n, hq, d = q.shape
    end = start + n
    cache.k[layer, :, start:end] = k.transpose(0, 1)
    cache.v[layer, :, start:end] = v.transpose(0, 1)
    mask = None
    if n > 1:  # row i sees slots 0 .. start + i
        mask = torch.arange(end)[None, :] <= (start + torch.arange(n))[:, None]  # [N, end]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], cache.k[layer, :, :end][None], cache.v[layer, :, :end][None],
        attn_mask=mask, scale=scale, enable_gqa=True)  # [1, Hq, N, d]
    return out[0].transpose(0, 1).reshape(n, hq * d)


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


def _pick_linear(dtype: torch.dtype, batch_invariant: bool, use_native: bool | None) -> kernels.LinearKernel:
    """The native kernel when it can run; else the portable invariant path (or, for a draft
    model whose numerics never affect exactness, plain ``F.linear``)."""
    from specdecode.models import native

    if use_native is not False and dtype == torch.float32 and native.load() is not None:
        return kernels.LinearKernel(kernels.linear_invariant, invariant=True)
    if batch_invariant:
        return kernels.LinearKernel(kernels.linear_invariant_portable, invariant=True)
    return kernels.LinearKernel(kernels.linear_fast, invariant=False)


def _causal_bias(start: int, n: int, span: int, group: int) -> Tensor:
    """Additive mask [G*N, span]: row (g, i) sees slots 0 .. start+i."""
    cols = torch.arange(span)
    visible = cols[None, :] <= (start + torch.arange(n))[:, None]  # [N, span]
    bias = torch.zeros(n, span).masked_fill_(~visible, float("-inf"))
    return bias.repeat(group, 1)
