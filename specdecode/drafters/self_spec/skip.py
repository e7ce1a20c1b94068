"""A layer-skipping view of a decoder: the same weights, fewer layers.

Self-speculation drafts with the target itself minus some layers (Draft&Verify, SWIFT). The view
must not copy anything: the target's weights are gigabytes and the view is only ever read. It is
a shallow copy of the decoder whose ``layers`` list holds the kept layers (the very same
``LayerWeights`` objects) and whose config counts only them, so ``new_cache`` allocates keys and
values for the kept layers alone. The decoder indexes its cache by position in ``layers``, so
the kept layers fill cache slots 0..kept-1 in order.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from specdecode.models.decoder import Decoder
from specdecode.models.weights import DecoderWeights
from specdecode.drafters.self_spec.layers import check_skip


def skip_layers(model: Decoder, skip: Sequence[int]) -> Decoder:
    """A view of ``model`` without the layers in ``skip``; every tensor is shared, none copied.

    The view computes with the model's own kernels (a native whole forward is built again over the
    kept layers). Mutating a shared tensor in place changes
    both; replacing an attribute of one (e.g. ``view.norm = ...``) does not affect the other.
    """
    dropped = set(check_skip(skip, model.config.num_layers))
    view = copy.copy(model)  # a new object whose attributes are the same tensors
    view.layers = [layer for i, layer in enumerate(model.layers) if i not in dropped]
    view.config = dataclasses.replace(model.config, num_layers=len(view.layers))
    # A native whole forward holds its layers: the view gets one over the kept layers.
    view.backend = model.backend.rebuilt(view.config, DecoderWeights(model.dtype, model.embed, model.lm_head, model.norm,
                                                                     view.layers, model.cos, model.sin))
    return view
