"""Choosing tokens exactly: ``penalties`` (penalties and logit bias) and ``grammar`` (structured
output) on the target's logits, ``sampling`` (temperature, top-k, top-p), the acceptance rules for
a chain of drafts (``chain``) and a tree (``tree``), and ``verify``, the one entry point to them."""
