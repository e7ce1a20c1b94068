"""How a decoder computes, chosen once when it is built: one backend class per weight format.

A ``Decoder`` holds its weights in one form (float, a target's per-row int8, a draft's packed int8
or int4, GGUF k-quants as shipped) and computes each layer's steps around its matrix products, and
its attention, in the way that form and its role allow. The backend is that choice, made once by
``choose`` (or by ``Decoder.from_gguf``) and passed in; nothing changes it afterwards.

The role matters where exactness does. A *target*'s rows must keep their bits however many rows
share a call (the verify forward runs K+1 rows where plain decoding runs one), so it takes the
batch-invariant kernels. A *draft* only proposes tokens the target verifies, so its numerics never
change the output: it takes whatever is fastest (fused SDPA attention, a fused norm, dynamic int8,
int4). A token tree's branches take the invariant attention in either role.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from specdecode.errors import InvalidConfigError, UnsupportedModelError
from specdecode.models import draft_quant, gguf_forward, kernel_build, kernels
from specdecode.models.attend import Attend, attend_blocked, attend_fast, attend_rows
from specdecode.models.config import ModelConfig
from specdecode.models.int4_forward import FusedForward, fused_int4_draft
from specdecode.models.int8_rows import QUANTIZE_MODES, quantize_rows
from specdecode.models.weights import DecoderWeights, LinearWeight

Role = Literal["target", "draft"]
ROLES: tuple[Role, ...] = ("target", "draft")
Linear = Callable[[Tensor, LinearWeight], Tensor]  # ``backend.linear`` or ``backend.linear.rows``


class Backend(ABC):
    """A decoder's way of computing. ``linear`` is the matrix product (``LinearKernel``: a lone
    sequence's prefill may leave the invariant path, ``linear.rows`` never does); the step
    methods take that product as ``linear`` and put a layer's norm, activation and residual around
    it. ``attend`` serves a chain of rows (decode, verify, prefill), ``attend_branch`` one
    root-to-leaf branch of a token tree; ``chain_keys`` says whether ``attend`` reads a key span and
    causal mask. ``fused``, when set, is a whole forward in one native call for calls of up to
    ``fused_rows`` rows without a tree or a capture; a longer input runs as chunks of it when
    ``fused_chunks``, else through the layers; ``fused_invariant`` says that it gives every row the
    layers' bits, so calls that must stay on the invariant path may take it."""

    role: Role
    linear: kernels.LinearKernel
    attend: Attend
    attend_branch: Attend
    chain_keys: bool
    fused: FusedForward | None = None
    fused_rows: int = 0
    fused_batch_rows: int | None = None  # most rows, all sequences together, of one batched fused call (None: any)
    fused_chunks: bool = True
    fused_invariant: bool = False

    def __init__(self, role: Role, linear: kernels.LinearKernel, invariant_attend: Attend, chain_keys: bool) -> None:
        """``invariant_attend``: this form's batch-invariant attention, a target's ``attend`` and
        every tree branch's; a draft's chains take one SDPA call instead (``attend.attend_fast``),
        which reads no key span (``chain_keys``: whether ``invariant_attend`` does)."""
        if role not in ROLES:
            raise InvalidConfigError(f"a decoder's role is one of {ROLES}, got {role!r}")
        self.role, self.linear = role, linear
        self.attend_branch = invariant_attend
        self.attend = attend_fast if role == "draft" else invariant_attend
        self.chain_keys = chain_keys and role == "target"

    def layered(self) -> "Backend":
        """This backend without a fused forward: every call through its layers (to compare or time
        the two)."""
        return self

    def rebuilt(self, config: ModelConfig, weights: DecoderWeights) -> "Backend":
        """This backend for ``weights``, of the same form as those it was built for but with some
        matrix replaced (a restricted LM head): a fused forward, which holds its weights, is
        built again over them; a backend that reads the weights per call is itself."""
        return self

    @abstractmethod
    def norm_linear(self, linear: Linear, x: Tensor, norm: Tensor, w: LinearWeight) -> Tensor:
        """RMS norm of ``x`` with weights ``norm``, then ``linear``."""

    @abstractmethod
    def linear_add(self, linear: Linear, x: Tensor, w: LinearWeight, residual: Tensor) -> Tensor:
        """``residual + linear(x, w)``."""

    @abstractmethod
    def glu_linear_add(self, linear: Linear, gate_up: Tensor, w: LinearWeight, residual: Tensor) -> Tensor:
        """``residual + linear(silu(gate) * up, w)`` of a fused gate|up."""

    @abstractmethod
    def rope(self, qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, hq: int,
             hkv: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [N, heads, d] of a fused q|k|v: bias added, RoPE on q and k."""


class TorchLayers(Backend):
    """A layer's steps around its matrix products as torch ops, and attention (a target's:
    ``attend_rows`` where the native kernels run, for float32 and int8 targets, else blocked over
    keys) or one fused SDPA call (a draft's), around any ``linear``."""

    def __init__(self, role: Role, eps: float, linear: kernels.LinearKernel, native_attend: bool = False) -> None:
        """``native_attend``: the row-wise native attention, which costs one call per layer where
        the blocked form's dozen small ops per layer are most of a small model's step."""
        if native_attend:
            super().__init__(role, linear, attend_rows, chain_keys=False)
        else:
            super().__init__(role, linear, attend_blocked, chain_keys=True)
        self.rms_norm = kernels.rms_norm if role == "target" else kernels.rms_norm_fast
        self.eps = eps

    def norm_linear(self, linear: Linear, x: Tensor, norm: Tensor, w: LinearWeight) -> Tensor:
        return linear(self.rms_norm(x, norm, self.eps), w)

    def linear_add(self, linear: Linear, x: Tensor, w: LinearWeight, residual: Tensor) -> Tensor:
        return residual + linear(x, w)

    def glu_linear_add(self, linear: Linear, gate_up: Tensor, w: LinearWeight, residual: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + linear(torch.nn.functional.silu(gate) * up, w)

    def rope(self, qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, hq: int,
             hkv: int) -> tuple[Tensor, Tensor, Tensor]:
        if bias is not None:
            qkv = qkv + bias
        n, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        q = kernels.apply_rope(q.view(n, hq, d), cos, sin)
        k = kernels.apply_rope(k.view(n, hkv, d), cos, sin)
        return q, k, v.view(n, hkv, d)


class FloatBackend(TorchLayers):
    """Float weights: the native kernel where it runs (float32), else the portable invariant path,
    or for a draft plain ``F.linear``."""

    def __init__(self, role: Role, eps: float, dtype: torch.dtype, use_native: bool | None) -> None:
        native = use_native is not False and dtype == torch.float32 and kernel_build.load() is not None
        if native:
            linear = kernels.LinearKernel(kernels.linear_invariant, invariant=True)
        elif role == "target":
            linear = kernels.LinearKernel(kernels.linear_invariant_portable, invariant=True)
        else:
            linear = kernels.LinearKernel(kernels.linear_fast, invariant=False)
        super().__init__(role, eps, linear, native_attend=native and _native_attention())


def _native_attention() -> bool:
    """Whether a float32 target's attention runs natively: the native kernels are on (not
    ``SPECDECODE_NATIVE=0``) and the row-wise attention builds; else the blocked torch form."""
    if kernel_build.load() is None:
        return False
    try:
        kernel_build.load_attention()
    except UnsupportedModelError:
        return False
    return True


class Int8RowsBackend(TorchLayers):
    """A target in per-row int8 with float activations (``int8_rows.py``): rows stay invariant."""

    def __init__(self, eps: float) -> None:
        super().__init__("target", eps, kernels.LinearKernel(kernels.linear_int8_invariant, invariant=True),
                         native_attend=_native_attention())

    @staticmethod
    def convert(weights: DecoderWeights) -> DecoderWeights:
        return weights.map_linear(quantize_rows)


class DraftQuantBackend(TorchLayers):
    """A draft in packed int8 or int4 (``draft_quant.py``); an all-int4 draft runs its decode rows
    through one native call (``int4_forward.py``)."""

    def __init__(self, eps: float, fused: FusedForward | None) -> None:
        super().__init__("draft", eps, kernels.LinearKernel(draft_quant.linear_draft, invariant=False))
        self.fused = fused
        self.fused_rows = draft_quant.FUSED_MAX_ROWS if fused is not None else 0
        self.fused_batch_rows = self.fused_rows

    @classmethod
    def build(cls, config: ModelConfig, weights: DecoderWeights, mode: str) -> tuple["DraftQuantBackend", DecoderWeights]:
        packed = weights.map_linear(lambda w: draft_quant.pack_draft(w, mode))
        return cls(config.rms_norm_eps, fused_int4_draft(config, packed)), packed

    def layered(self) -> "DraftQuantBackend":
        return DraftQuantBackend(self.eps, None)

    def rebuilt(self, config: ModelConfig, weights: DecoderWeights) -> "DraftQuantBackend":
        return self if self.fused is None else DraftQuantBackend(self.eps, fused_int4_draft(config, weights))


class GGUFBackend(Backend):
    """GGUF k-quants run as shipped (``kernels.linear_gguf``, invariant for every row count,
    prefills included), each step one kernel call with the norm, the gated activation or the
    residual add fused in (a decode step of the 1.5B target made some 200 small torch calls for
    them), and the row-wise native attention, which needs no key span or mask. The kernels are
    built (or refused, by name) here rather than at the first forward."""

    fused_chunks = False  # a prompt takes the layers: their wide tiles serve many rows
    fused_invariant = True

    def __init__(self, role: Role, eps: float, fused: FusedForward | None = None) -> None:
        """``fused``: the native whole forward over the weights (``gguf_forward.fused_gguf``), which
        ``rebuilt`` makes once they are loaded."""
        kernel_build.load_gguf()
        kernel_build.load_attention()
        super().__init__(role, kernels.LinearKernel(kernels.linear_gguf, invariant=True, always=True), attend_rows,
                         chain_keys=False)
        self.eps = eps
        self.fused = fused
        self.fused_rows = gguf_forward.FUSED_MAX_ROWS if fused is not None else 0

    def layered(self) -> "GGUFBackend":
        return GGUFBackend(self.role, self.eps)

    def rebuilt(self, config: ModelConfig, weights: DecoderWeights) -> "GGUFBackend":
        return GGUFBackend(self.role, self.eps, gguf_forward.fused_gguf(config, weights))

    def norm_linear(self, linear: Linear, x: Tensor, norm: Tensor, w: LinearWeight) -> Tensor:
        return kernels.linear_gguf(x, w, norm=norm, eps=self.eps)

    def linear_add(self, linear: Linear, x: Tensor, w: LinearWeight, residual: Tensor) -> Tensor:
        return kernels.linear_gguf(x, w, residual=residual.contiguous())

    def glu_linear_add(self, linear: Linear, gate_up: Tensor, w: LinearWeight, residual: Tensor) -> Tensor:
        return kernels.linear_gguf(gate_up, w, glu=True, residual=residual.contiguous())

    def rope(self, qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, hq: int,
             hkv: int) -> tuple[Tensor, Tensor, Tensor]:
        n, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
        q, k, v = kernels.rope_qkv(qkv, bias, cos, sin, hq, hkv).split((hq * d, hkv * d, hkv * d), dim=-1)
        return q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)


def choose(config: ModelConfig, weights: DecoderWeights, role: Role, use_native: bool | None,
           quantize: str | None) -> tuple[Backend, DecoderWeights]:
    """The backend for float ``weights`` in ``role`` and the weights in its form. ``quantize="int8"``:
    per-row int8 weights with float activations for a target (rows stay invariant), fbgemm's
    dynamic int8 for a draft; ``"int4"`` (drafts): int4 weights for its decode rows.
    ``use_native``: the compiled float kernel (None = when available); False forces the portable
    torch path."""
    if role not in ROLES:
        raise InvalidConfigError(f"a decoder's role is one of {ROLES}, got {role!r}")
    if quantize is None:
        return FloatBackend(role, config.rms_norm_eps, weights.dtype, use_native), weights
    modes = QUANTIZE_MODES if role == "target" else draft_quant.DRAFT_MODES
    if quantize not in modes or weights.dtype != torch.float32:
        raise InvalidConfigError(f"quantize must be one of {modes} with float32, got {quantize!r}")
    if role == "target":
        return Int8RowsBackend(config.rms_norm_eps), Int8RowsBackend.convert(weights)
    return DraftQuantBackend.build(config, weights, quantize)
