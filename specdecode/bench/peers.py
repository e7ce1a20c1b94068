"""Hugging Face transformers as the peer: what users would run instead of specdecode.

Three contestants on the same weights and dtype as ours: ``hf_target`` (plain ``generate``),
``hf_assisted`` (``assistant_model=`` the same draft, HF's default assistant settings, since those
are what users get) and ``hf_prompt_lookup`` (``prompt_lookup_num_tokens=K``). Each returns a
``GenerationOutput`` so the runner treats it like ours: timed in the same interleaved loop and
compared token by token with our ``none`` output.

transformers is imported only when peers are requested: it is a test/benchmark dependency, and
loading it costs seconds the plain benchmark should not pay.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specdecode.bench.runner import Contestant
from specdecode.params import SamplingParams
from specdecode.engine.generation import GenerationOutput
from specdecode.errors import SpecDecodeError
from specdecode.engine.stats import RequestStats
from specdecode.tokenizer import Tokenizer

PEER_NAMES = ("hf_target", "hf_assisted", "hf_prompt_lookup")


class PeerUnavailableError(SpecDecodeError):
    """transformers is not installed or cannot load the model folder."""


def hf_contestants(target_dir: Path, draft_dir: Path | None, dtype: str, tokenizer: Tokenizer,
                   k: int, share: tuple[Any, Any] = (None, None)) -> tuple[list[Contestant], dict[str, dict[str, Any]]]:
    """The HF contestants and, per peer, the settings it ran with (reported in summary.json).

    Without a draft model ``hf_assisted`` is left out (there is nothing to assist with).
    ``share`` holds our loaded target and draft decoders: where given, the HF models use their
    weight tensors instead of loading a second copy (see ``_load``).
    """
    torch_dtype = _torch_dtype(dtype)
    eos = sorted(tokenizer.eos_token_ids)
    target = _load(target_dir, torch_dtype, eos, share[0])
    contestants = [Contestant("hf_target", "none", None, "peer", _generator(target, tokenizer, eos, {}))]
    settings: dict[str, dict[str, Any]] = {"hf_target": {"library": _version()}}
    if draft_dir is not None:
        draft = _load(draft_dir, torch_dtype, eos, share[1])
        contestants.append(Contestant("hf_assisted", "draft_model", None, "peer",
                                      _generator(target, tokenizer, eos, {"assistant_model": draft})))
        settings["hf_assisted"] = {"library": _version(), **_assistant_settings(draft)}
    contestants.append(Contestant("hf_prompt_lookup", "ngram", k, "peer",
                                  _generator(target, tokenizer, eos, {"prompt_lookup_num_tokens": k})))
    settings["hf_prompt_lookup"] = {"library": _version(), "prompt_lookup_num_tokens": k}
    return contestants, settings


def _assistant_settings(draft: Any) -> dict[str, Any]:
    """The assistant settings HF will use: the draft's generation config over HF's defaults
    (the same resolution ``AssistedCandidateGenerator`` does), so the report names real values."""
    gc = draft.generation_config
    try:
        defaults = gc._get_default_generation_params()
    except AttributeError:  # another transformers version: report what is set
        defaults = {}
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {n: getattr(gc, n, None) if getattr(gc, n, None) is not None else defaults.get(n) for n in names}


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def _version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def _load(path: Path, torch_dtype: Any, eos: list[int], share: Any = None) -> Any:
    """Load an HF folder and give it a neutral generation config: a model folder may carry
    sampling defaults or a repetition penalty that our engine does not apply, which would make the
    comparison one of decoding rules instead of engines.

    With ``share`` (our Decoder of the same folder), the HF model's parameters are views of our
    tensors: the same bytes, no second copy. Two copies of both models (about 19 GB in fp32 for
    the default pair) leave this 24 GiB machine paging weights in and out between contestants,
    which made the timings noise.
    """
    try:
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError:
        raise PeerUnavailableError("--peers hf needs transformers: pip install 'specdecode[test]'") from None
    try:
        if share is not None and _shareable(share, torch_dtype):
            model = _shared_model(path, share)
        else:
            from specdecode.models.gguf_convert import MARKER_NAME, write_float_weights

            if (Path(path) / MARKER_NAME).is_file():  # converted from GGUF: floats are made on demand
                write_float_weights(Path(path))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise PeerUnavailableError(f"transformers cannot load {path}: {exc}") from None
    model.eval()
    cfg = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=getattr(cfg, "bos_token_id", None), eos_token_id=eos, pad_token_id=eos[0] if eos else None
    )
    return model


def _shareable(decoder: Any, torch_dtype: Any) -> bool:
    import torch

    weights = [decoder.lm_head] + [w.qkv for w in decoder.layers]
    return decoder.dtype == torch_dtype and all(isinstance(w, torch.Tensor) for w in weights)


def _shared_model(path: Path, decoder: Any) -> Any:
    """An HF model built on the meta device whose parameters are assigned views of ``decoder``'s
    packed tensors (q|k|v and gate|up are split back into HF's separate projections)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=decoder.dtype)
    model.load_state_dict(_hf_state(decoder), strict=True, assign=True)
    for name, module in list(model.named_modules()):  # non-persistent buffers (RoPE) stay on meta
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, name.rpartition(".")[2], type(module)(config=model.config))
    return model


def _hf_state(decoder: Any) -> dict[str, Any]:
    cfg = decoder.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    state = {"model.embed_tokens.weight": decoder.embed, "model.norm.weight": decoder.norm,
             "lm_head.weight": decoder.lm_head}
    for i, w in enumerate(decoder.layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = w.in_norm
        state[p + "post_attention_layernorm.weight"] = w.post_norm
        for name, (a, b) in {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}.items():
            state[f"{p}self_attn.{name}_proj.weight"] = w.qkv[a:b]
            if w.qkv_bias is not None:
                state[f"{p}self_attn.{name}_proj.bias"] = w.qkv_bias[a:b]
        state[p + "self_attn.o_proj.weight"] = w.o
        state[p + "mlp.gate_proj.weight"] = w.gate_up[:inter]
        state[p + "mlp.up_proj.weight"] = w.gate_up[inter:]
        state[p + "mlp.down_proj.weight"] = w.down
    return state


class _FirstTokenClock:
    """A streamer that notes when the first new token arrives (generate's first ``put`` is the
    prompt), so a peer's TTFT and TPOT are measured like ours."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _generator(model: Any, tokenizer: Tokenizer, eos: list[int], extra: dict[str, Any]):
    """A ``Generate`` callable running ``model.generate`` with our sampling settings."""
    import torch

    def generate(ids: list[int], params: SamplingParams) -> GenerationOutput:
        kwargs: dict[str, Any] = dict(max_new_tokens=params.max_tokens, do_sample=not params.greedy, **extra)
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            torch.manual_seed(params.seed if params.seed is not None else 0)
        clock = _FirstTokenClock()
        input_ids = torch.tensor([ids], dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=clock, **kwargs)
        total = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        stats = RequestStats(prompt_tokens=len(ids), completion_tokens=len(new), total_s=total,
                             ttft_s=(clock.first - start) if clock.first is not None else 0.0)
        return GenerationOutput(
            text=tokenizer.decode(new), token_ids=new, finish_reason=_finish(new, eos),
            prompt_token_ids=list(ids), method="hf", stats=stats,
        )

    return generate


def _finish(tokens: list[int], eos: Iterable[int]) -> str:
    return "stop" if tokens and tokens[-1] in set(eos) else "length"
