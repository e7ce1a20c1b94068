"""Self-speculation: the target drafts for itself with some of its layers skipped.

No second model, no extra weights, and the vocabulary matches by construction: the draft is a
view of the target (``self_spec/skip.py``) that shares every tensor and runs only the kept
layers, with its own KV cache for them. Everything else (drafting K tokens one forward at a time,
the confidence stop, rolling back rejected drafts) is the draft-model drafter's, unchanged.

Which layers to skip comes from ``specdecode calibrate`` (``self_spec/layers.load_skip``) or,
without a calibration, from ``default_skip``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.models.decoder import Decoder
from specdecode.drafters.self_spec.layers import check_skip, default_skip
from specdecode.drafters.self_spec.skip import skip_layers


class SelfSpecDrafter(DraftModelDrafter):
    name: ClassVar[str] = "self"
    draft_cost_prior: ClassVar[float] = 0.5  # about half the target's layers

    def __init__(self, target: Decoder, skip: Sequence[int] | None, capacity: int,
                 confidence: float = 0.0) -> None:
        """``skip``: target layer indices the draft leaves out (None: ``default_skip``); an empty
        list drafts with the whole target, which every draft then survives (useful as a check).
        ``capacity`` and ``confidence`` as for ``DraftModelDrafter``."""
        n = target.config.num_layers
        self.skip = tuple(default_skip(n) if skip is None else check_skip(skip, n))
        super().__init__(skip_layers(target, self.skip), target.config.vocab_size, capacity, confidence)
