"""Which methods the losslessness tests run, read from the registry, and tiny heads for the methods
that need one.

A new row in ``specdecode/drafters/registry.py`` is in ``SPEC_METHODS`` at once, so it gets the
greedy-identity (tests/test_lossless.py), sampling-law (tests/test_sampling_lossless.py) and
batched-equals-solo (tests/test_scheduler.py) tests and every other test parametrized by
``SPEC_METHODS``. A method whose ``Method.needs`` names a head (a ``DraftResources`` field, which is
also ``LLM``'s keyword) runs with an untrained head from ``HEAD_BUILDERS``: the tests check
exactness, which holds for any head, and an untrained head starts from the target's own LM head,
so some of its drafts are accepted and some rejected. tests/test_registry_coverage.py fails when a
method is left out of those tests without a named reason in ``EXCLUDED``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdecode import LLM
from specdecode.drafters.registry import METHOD_NAMES, REGISTRY
from specdecode.engine.policy import DraftRequest, SpeculationPolicy
from specdecode.heads.eagle3 import Eagle3Config
from specdecode.heads.eagle3_format import save_eagle3
from specdecode.heads.medusa import MedusaConfig
from specdecode.heads.medusa_format import save_medusa
from specdecode.models.config import config_fingerprint
from specdecode.train.eagle3 import new_head
from specdecode.train.medusa import new_heads

# A registered method that truly cannot run in the shared losslessness tests -> why (none today).
EXCLUDED: dict[str, str] = {}
# Every other speculative method; each must reproduce plain decoding token for token.
SPEC_METHODS: tuple[str, ...] = tuple(name for name in METHOD_NAMES if name != "none" and name not in EXCLUDED)
# The ``DraftResources`` fields that registered methods need (trained heads).
HEAD_FIELDS: tuple[str, ...] = tuple(sorted({m.needs for m in REGISTRY.values() if m.needs is not None}))


def _eagle_head(llm: LLM, out: Path) -> Path:
    """An EAGLE-3 head as ``specdecode train eagle3`` starts it (the target's LM head and norm),
    over the whole vocabulary."""
    target = llm.target
    cfg = Eagle3Config.for_target(target.config, intermediate_size=96)
    head = new_head(target, cfg, torch.arange(target.config.vocab_size))
    return save_eagle3(head, out, target_name="tiny", target_fingerprint=config_fingerprint(llm.model_dir))


def _medusa_heads(llm: LLM, out: Path) -> Path:
    """Three Medusa heads as ``specdecode train medusa`` starts them (each the target's LM head)."""
    target = llm.target
    cfg = MedusaConfig(target.config.hidden_size, target.config.vocab_size, num_heads=3)
    heads = new_heads(target, cfg, torch.arange(target.config.vocab_size))
    return save_medusa(heads, out, target_name="tiny", target_fingerprint=config_fingerprint(llm.model_dir))


# A ``DraftResources`` field a method needs -> how to make one for a loaded tiny target.
HEAD_BUILDERS: dict[str, Callable[[LLM, Path], Path]] = {
    "eagle_head": _eagle_head,
    "medusa_heads": _medusa_heads,
}


def tiny_heads(llm: LLM, root: Path) -> dict[str, str]:
    """For every head a registered method needs, one for ``llm``'s target (saved under ``root``),
    keyed by ``LLM``'s keyword for it."""
    return {field: str(HEAD_BUILDERS[field](llm, root / field)) for field in HEAD_FIELDS}


class RandomK(SpeculationPolicy):
    """A policy that changes every request's K (0 included) and draft source at random each
    step, from its own random stream (never a request's), so exactness tests see K change
    step to step: the output must not."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, requests: Sequence[DraftRequest]) -> list[int]:
        return [self.rng.randint(0, r.limit) if r.adaptive else r.limit for r in requests]

    def pick_sources(self, options: Sequence[Sequence[DraftRequest]]) -> list[int]:
        return [self.rng.randrange(len(o)) for o in options]
