"""The training loop every trained drafter shares: AdamW over captured examples, a time budget,
validation, and checkpoints that survive a kill.

One example (one sequence) per optimizer step: sequences are long enough (hundreds of positions)
that their gradient is not noisy, and CPU time goes to the model rather than to padding. The
order is a seeded permutation per epoch, so a resumed run sees what the uninterrupted one would.

The checkpoint (``OUT/checkpoint/``: weights, optimizer, step, time used, validation history) is
written whole beside the old one and swapped in (``heads.folders``), so a kill at any moment
leaves the last good checkpoint; ``resume`` continues from it with the budget that was left.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from specdecode.errors import CheckpointError
from specdecode.files import recover, write_folder
from specdecode.train.capture import Example

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.pt"


@dataclass(frozen=True, slots=True)
class LoopConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    budget_minutes: float | None = None  # wall time for optimizer steps (not capture); None: no limit
    max_steps: int | None = None  # None: until the budget runs out (at least one is needed)
    eval_every: int = 50  # steps between validations
    checkpoint_every_s: float = 120.0
    seed: int = 0
    grad_clip: float = 1.0


@dataclass(slots=True)
class LoopState:
    step: int = 0
    elapsed_s: float = 0.0
    history: list[dict] = field(default_factory=list)  # {"step", "loss", **validation}


def run(model: nn.Module, train_set: Sequence[Example], loss_fn: Callable[[Example], Tensor],
        validate: Callable[[], dict], out: Path, cfg: LoopConfig, *, resume: bool = False,
        on_checkpoint: Callable[[LoopState], None] | None = None, progress: bool = True) -> LoopState:
    """Train ``model`` in place; returns the final state (its history ends with a validation)."""
    from tqdm import tqdm

    if cfg.budget_minutes is None and cfg.max_steps is None:
        raise ValueError("give a time budget or a step count")
    if not train_set:
        raise ValueError("no training examples")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = LoopState()
    if resume:
        state = _load(Path(out), model, optimizer)
    budget_s = math.inf if cfg.budget_minutes is None else cfg.budget_minutes * 60.0
    max_steps = cfg.max_steps if cfg.max_steps is not None else sys.maxsize
    losses: list[float] = []
    last_save = time.monotonic()
    total = None if cfg.max_steps is None else cfg.max_steps
    with tqdm(total=total, initial=state.step, desc="training", unit="step", file=sys.stderr,
              disable=not progress) as bar:
        while state.step < max_steps and state.elapsed_s < budget_s:
            t0 = time.monotonic()
            example = train_set[_order(len(train_set), cfg.seed, state.step)]
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * min(1.0, (state.step + 1) / max(cfg.warmup_steps, 1))
            model.train()
            loss = loss_fn(example)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            state.step += 1
            state.elapsed_s += time.monotonic() - t0
            losses.append(loss.item())
            bar.update(1)
            if state.step % cfg.eval_every == 0:
                _validate(model, validate, state, losses, bar)
            if time.monotonic() - last_save >= cfg.checkpoint_every_s:
                _save(Path(out), model, optimizer, state, on_checkpoint)
                last_save = time.monotonic()
    if not state.history or state.history[-1]["step"] != state.step:
        _validate(model, validate, state, losses, None)
    _save(Path(out), model, optimizer, state, on_checkpoint)
    return state


def _order(n: int, seed: int, step: int) -> int:
    """The example of ``step``: a fresh seeded permutation each epoch."""
    epoch, index = divmod(step, n)
    return _permutation(n, seed, epoch)[index]


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist())


def _validate(model: nn.Module, validate: Callable[[], dict], state: LoopState, losses: list[float], bar) -> None:
    model.eval()
    metrics = validate()
    record = {"step": state.step, "loss": round(sum(losses) / len(losses), 4) if losses else None, **metrics}
    losses.clear()
    state.history.append(record)
    if bar is not None:
        bar.set_postfix({k: v for k, v in record.items() if k in ("loss", "tau", "agree")})


def _save(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: LoopState,
          on_checkpoint: Callable[[LoopState], None] | None) -> None:
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": state.step,
               "elapsed_s": state.elapsed_s, "history": state.history}
    write_folder(out / CHECKPOINT_DIR, lambda folder: torch.save(payload, folder / STATE_FILE))
    if on_checkpoint is not None:
        on_checkpoint(state)


def _load(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> LoopState:
    folder = out / CHECKPOINT_DIR
    recover(folder)
    path = folder / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"nothing to resume: no checkpoint in {folder}; run without --resume to start")
    try:
        payload = torch.load(path, weights_only=True)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, KeyError, ValueError, OSError) as exc:
        raise CheckpointError(f"cannot resume from {path} (damaged, or from another configuration): {exc}") from None
    return LoopState(int(payload["step"]), float(payload["elapsed_s"]), list(payload["history"]))
