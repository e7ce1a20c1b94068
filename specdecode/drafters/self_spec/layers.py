"""Which layers self-speculation skips: a default heuristic and the calibrated choice on disk.

``specdecode calibrate`` measures a skip set for one model and stores it next to the model as
``specdecode-self.json``; ``load_skip`` reads it back, and ``default_skip`` is the fallback when
no calibration exists. The file carries a fingerprint of the model's ``config.json`` so that a
file left from another model (a folder reused, a file copied) is ignored with a warning rather
than silently applied to a model it was not measured on.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from collections.abc import Sequence
from pathlib import Path

from specdecode.errors import InvalidConfigError
from specdecode.files import atomic_path
from specdecode.models.config import ModelConfig, config_fingerprint

SKIP_FILE_NAME = "specdecode-self.json"
SKIP_FILE_FORMAT = 1
# ``specdecode calibrate``'s defaults (``calibrate.py`` searches; the CLI reads these without it).
DEFAULT_MAX_SKIP = 0.5
DEFAULT_CALIBRATION_K = 4
DEFAULT_CALIBRATION_TOKENS = 64
DEFAULT_CANDIDATES = 4  # layers re-tried per round after the first (see calibrate.search_skip)


@dataclass(frozen=True, slots=True)
class SkipChoice:
    """A calibrated skip set and the estimate it was chosen by (see ``calibrate.py``)."""

    skip: list[int]
    alpha: float  # teacher-forced greedy agreement of the skip view with the target
    estimated_speedup: float  # tokens per target-forward cost, against plain decoding
    k: int  # the draft length the estimate assumes
    best_k: int  # the draft length that maximizes the estimate for this set
    draft_cost: float  # one draft forward's cost as a fraction of a target forward
    num_layers: int
    fingerprint: str  # of the model's config.json
    prompts: int
    tokens: int  # continuation tokens scored
    created: str  # ISO 8601, UTC
    format: int = SKIP_FILE_FORMAT


def check_skip(skip: Sequence[int], num_layers: int) -> list[int]:
    """``skip`` as a sorted list, or ``InvalidConfigError`` naming what is wrong with it."""
    values = list(skip)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in values):
        raise InvalidConfigError(f"layers to skip must be integers, got {values!r}")
    bad = [i for i in values if not 0 <= i < num_layers]
    if bad:
        raise InvalidConfigError(
            f"cannot skip layers {bad}: the model has layers 0..{num_layers - 1}"
        )
    if len(set(values)) != len(values):
        raise InvalidConfigError(f"layers to skip are listed twice: {values!r}; list each layer once")
    if len(values) >= num_layers:
        raise InvalidConfigError(
            f"cannot skip all {num_layers} layers: at least one layer must remain to draft with"
        )
    return sorted(values)


def default_skip(num_layers: int) -> list[int]:
    """About half the layers, spread evenly over the middle, keeping the first and last eighth.

    Why this shape: the first layers build token representations and the last ones map them to
    the vocabulary, and dropping either breaks agreement badly; the middle layers change the
    residual stream least, so self-speculation work (Draft&Verify, SWIFT) finds its skip sets
    there, typically around half the layers. Spreading the skipped layers (rather than one block)
    leaves every stretch of the network some computation. Two layers: skip the second.
    """
    if num_layers < 2:
        raise InvalidConfigError(f"self-speculation needs a model of at least 2 layers, this one has {num_layers}")
    if num_layers == 2:
        return [1]
    edge = max(1, round(num_layers / 8))
    middle = list(range(edge, num_layers - edge))
    count = min(len(middle), num_layers // 2)
    step = len(middle) / count
    return sorted({middle[int(i * step + step / 2)] for i in range(count)})


def skip_file(model_dir: Path) -> Path:
    return Path(model_dir) / SKIP_FILE_NAME


def save_skip(choice: SkipChoice, path: Path) -> Path:
    """Write ``choice`` as JSON atomically (``files.atomic_path``): readers never see half a file."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(asdict(choice), indent=2) + "\n")
    except OSError as exc:
        raise InvalidConfigError(
            f"cannot write the calibration to {path}: {exc.strerror}; pass --output PATH somewhere writable"
        ) from None
    return path


def load_skip(model_dir: Path, config: ModelConfig, path: Path | None = None) -> list[int] | None:
    """The calibrated skip list for the model in ``model_dir``, or None when there is no usable one.

    ``path`` defaults to ``model_dir/specdecode-self.json``. A file that is unreadable, made for
    another model (fingerprint or layer count differ) or lists invalid layers is ignored with a
    ``UserWarning`` saying how to recalibrate: a wrong skip set would only cost speed, never
    exactness, so it is not worth an error.
    """
    path = Path(path) if path is not None else skip_file(model_dir)
    if not path.is_file():
        return None
    hint = f"ignoring it; run `specdecode calibrate --model {model_dir}` to recalibrate"
    try:
        data = json.loads(path.read_text())
        skip, layers, stored = list(data["skip"]), int(data["num_layers"]), str(data["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{path} is not a valid calibration file ({exc}); {hint}", stacklevel=2)
        return None
    if stored != config_fingerprint(model_dir) or layers != config.num_layers:
        warnings.warn(f"{path} was calibrated for another model (fingerprint {stored}, {layers} layers); {hint}",
                      stacklevel=2)
        return None
    try:
        return check_skip(skip, config.num_layers)
    except InvalidConfigError as exc:
        warnings.warn(f"{path} lists an invalid skip set ({exc}); {hint}", stacklevel=2)
        return None
