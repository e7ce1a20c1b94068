"""specdecode: lossless speculative decoding for LLMs.

Heavy imports (torch, the model code) happen on first use of ``LLM``, not at ``import specdecode``,
so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specdecode.config import SpecConfig
from specdecode.params import Constraint, SamplingParams
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.api import LLM
    from specdecode.engine.generation import GenerationOutput

__all__ = ["LLM", "Constraint", "GenerationOutput", "SamplingParams", "SpecConfig", "SpecDecodeError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from specdecode.api import LLM

        return LLM
    if name == "GenerationOutput":
        from specdecode.engine.generation import GenerationOutput

        return GenerationOutput
    raise AttributeError(name)
