"""The EAGLE-3 draft head: one decoder layer that drafts from the target's own hidden states.

A draft model re-derives from tokens what the target already knows; an EAGLE head reads it. The
target's hidden states at a low, a middle and a high layer (``hidden_layers``, by default
2, L/2 and L-3 as in vLLM and SpecForge) are concatenated and projected by ``fc`` to the head's
width; the one layer combines that feature with the embedding of the next token and predicts
the token after it. Later draft steps feed the layer's own output back as the feature. Its LM
head covers a reduced draft vocabulary (the tokens most frequent in the training data), mapped to
target ids by ``d2t``: target id = draft id + d2t[draft id].

Conventions are those of vLLM, SpecForge and the EAGLE code, so heads move between them:
- ``hidden_layers`` name the *input* of target layer i (Hugging Face's ``hidden_states[i]``);
- the layer's attention reads ``[input_layernorm(embeddings), hidden_norm(feature)]`` and the
  residual is the feature before its norm; the next step's feature is the output before ``norm``;
- row i (the target's state at position i with the token at position i + 1) runs at position i,
  and each later draft step one position further.

The module holds float weights and serves training (``unrolled_logits``, the training-time test
of EAGLE-3) and drafting (``step``) through one ``layer`` function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.models import kernels
from specdecode.models.config import ModelConfig


def default_hidden_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and SpecForge's choice: inputs of layers 2, L/2 and L-3 (for models of fewer than
    8 layers, which only tests use, those clamped to 0..L without repeats)."""
    return tuple(sorted({min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)}))


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    hidden_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_layers", tuple(int(i) for i in self.hidden_layers))
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if list(self.hidden_layers) != sorted(set(self.hidden_layers)):
            raise ValueError(f"hidden_layers must ascend without repeats, got {self.hidden_layers}")

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None) -> "Eagle3Config":
        """A head shaped like one of ``target``'s layers (its width, heads and RoPE), with a
        smaller MLP or vocabulary when given."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            hidden_layers=default_hidden_layers(target.num_layers),
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "hidden_layers": list(self.hidden_layers)}


class _Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)


# attend(q [N, heads, d], k [N, kv_heads, d], v [N, kv_heads, d]) -> [N, heads * d]: the caller
# decides which keys each row sees (a cache, earlier unrolled steps, a tree's ancestors).
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class Eagle3Head(nn.Module):
    """Weights named as the SpecForge/EAGLE checkpoints name them (``midlayer.*``, ``fc``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``). The token embedding is the target's, passed in."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.hidden_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.t2d[: cfg.draft_vocab_size] = True
        cos, sin = kernels.rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_vocabulary(self, draft_to_target: Tensor) -> None:
        """Make the draft vocabulary the target ids ``draft_to_target`` [draft_vocab_size] (ascending)."""
        ids = draft_to_target.to(torch.int64)
        if ids.shape != self.d2t.shape or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"need {self.d2t.shape[0]} ascending target ids")
        self.d2t.copy_(ids - torch.arange(ids.shape[0]))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> Tensor:
        """The target id of each draft id [draft_vocab_size]."""
        return self.d2t + torch.arange(self.d2t.shape[0])

    def project(self, states: Tensor) -> Tensor:
        """Target hidden states [N, len(hidden_layers) * target width] -> features [N, H]."""
        return self.fc(states.to(self.norm.weight.dtype))

    def layer(self, feature: Tensor, embeds: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """One pass of the decoder layer over rows [N]: returns the next features [N, H] (before
        ``norm``), which are also what ``logits`` reads."""
        cfg, m = self.config, self.midlayer
        n = feature.shape[0]
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(feature)], dim=-1)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        q = kernels.apply_rope(m.self_attn.q_proj(x).view(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = kernels.apply_rope(m.self_attn.k_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = m.self_attn.v_proj(x).view(n, cfg.num_kv_heads, cfg.head_dim)
        h = feature + m.self_attn.o_proj(attend(q, k, v))
        return h + m.mlp(m.post_attention_layernorm(h))

    def logits(self, feature: Tensor) -> Tensor:
        """Draft-vocabulary logits [N, draft_vocab_size]."""
        return self.lm_head(self.norm(feature))

    def unrolled_logits(self, states: Tensor, embeds: Tensor, steps: int) -> list[Tensor]:
        """The training-time test: ``steps`` draft steps over a whole sequence at once.

        ``states`` [T, ...]: the target's states at positions 0..T-1; ``embeds`` [T + steps - 1, H]:
        the embeddings of the tokens at positions 1..T + steps - 1. Step j's row i drafts the token
        at position i + j + 2 from step j-1's output at row i and the true token at position
        i + j + 1, attending to step 0's rows 0..i and to its own row in steps 1..j: exactly what
        drafting step j + 1 sees at inference. Returns each step's logits [T, draft_vocab_size].
        """
        t = states.shape[0]
        feature = self.project(states)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        out = []
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        diagonal = torch.eye(t, dtype=torch.bool)
        for j in range(steps):

            def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                keys.append(k)
                values.append(v)
                mask = torch.cat([causal] + [diagonal] * (len(keys) - 1), dim=1)
                return attention(q, torch.cat(keys), torch.cat(values), mask)

            positions = torch.arange(t) + j
            feature = self.layer(feature, embeds[j : j + t], positions, attend)
            out.append(self.logits(feature))
        return out


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [N, heads, d] over k, v [M, kv_heads, d] where ``mask`` [N, M] is True -> [N, heads * d]."""
    n, heads, d = q.shape
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=k.shape[1] != heads)
    return out[0].transpose(0, 1).reshape(n, heads * d)
