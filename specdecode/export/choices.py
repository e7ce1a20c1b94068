"""What an export can be asked for, kept free of heavy imports so that the CLI's flags and their
help read it without loading torch: the weights' dtypes, and our methods against vLLM's."""

from __future__ import annotations

EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what an export's weights (and vLLM) compute in
DEFAULT_VLLM_K = 5

# Our method -> vLLM's ``method``.
VLLM_METHODS: dict[str, str | None] = {
    "none": None, "ngram": "ngram", "draft_model": "draft_model", "eagle": "eagle3", "medusa": "medusa",
    "suffix": "suffix",
}
# Ours that vLLM lacks -> the nearest vLLM method and why.
NEAREST: dict[str, str] = {
    "lookahead": "ngram (vLLM copies n-grams from the context; it has no Jacobi lookahead)",
    "self": "draft_model with a small model of the target's vocabulary, or eagle3 with a head from "
            "`specdecode train eagle3` (vLLM has no layer-skipping self-speculation)",
    "combined": "ngram or draft_model (vLLM runs one drafter per server)",
    "tree": "draft_model (vLLM drafts chains from a draft model; its token trees are for EAGLE heads on GPUs)",
}
