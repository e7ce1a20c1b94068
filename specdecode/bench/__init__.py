"""The benchmark harness behind ``specdecode bench``.

workloads / specbench  -> prompts (built-in workloads, or Spec-Bench question.jsonl)
runner                 -> interleaved, warmed-up, identity-checked measurements (one row each)
peers / endpoint       -> other contestants: Hugging Face transformers, any OpenAI-compatible server
summary / report       -> summary.json (with the advice), summary.md, results.jsonl, PNG plots

Nothing is imported here, so ``import specdecode.bench.workloads`` stays cheap.
"""
