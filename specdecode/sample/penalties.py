"""Penalties and logit bias on the target's logits, row by row.

For a row deciding the token after prompt P and output O (the generated tokens before it):

- ``logit_bias`` (OpenAI): ``logit[t] += bias[t]``;
- ``repetition_penalty`` r (vLLM, HF): for every t in P or O, a positive logit becomes
  ``logit / r`` and any other ``logit * r`` (r > 1 makes seen tokens less likely);
- ``frequency_penalty`` f (OpenAI): ``logit[t] -= f * count_O(t)``;
- ``presence_penalty`` p (OpenAI): ``logit[t] -= p`` if t occurs in O.

They apply in that order, as vLLM's sampler applies them (logits processors, among them
``logit_bias``, then repetition, frequency, presence); the grammar mask, temperature, top-k and
top-p follow (``grammar.py``, ``sampling.py``). Presence and frequency count only generated
tokens, as OpenAI and vLLM do; repetition counts the prompt too, as vLLM does.

Why speculation stays exact: a verify step's row r holds the target's logits at the position
after the committed output and the drafts on r's path (``DraftProposal.row_paths``). Row r is
penalised with the counts of exactly those tokens, which are the counts plain decoding would have
at that position had it emitted those drafts; and row r only decides a token when they were all
accepted. So every row the acceptance rule reads is the penalised target's row for its position:
greedy output is penalised plain decoding's, token for token, and sampled output has the
penalised law. Every operation is elementwise, so a row's bits depend neither on the other rows
nor on which other tokens have columns. Drafters ignore the penalties: they only propose, so a
penalty can lower acceptance but never change the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.params import SamplingParams


def apply_penalties(
    logits: Tensor,  # [N, V] one verify row per position
    params: SamplingParams,
    tokens: Tensor,  # [C] int64, distinct token ids: those the counts cover
    counts: Tensor,  # [N, C] float32: how often tokens[c] occurs in the output before row n
    in_prompt: Tensor,  # [C] bool: tokens[c] occurs in the prompt
) -> Tensor:  # [N, V] a new tensor; ``logits`` is never modified
    """The logits after ``params``' logit bias, repetition, frequency and presence penalties (in
    that order). Beyond one copy of the logits, only the columns ``tokens`` and the biased ids
    are touched: a step costs the distinct tokens seen, not the vocabulary."""
    out = logits.clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        out.index_add_(1, torch.tensor(ids), torch.tensor(biases, dtype=out.dtype).expand(out.shape[0], -1))
    if not tokens.numel():
        return out
    seen = counts > 0  # [N, C]
    x = out.index_select(1, tokens)  # [N, C]
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        x = torch.where(seen | in_prompt, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty:
        x = x - params.presence_penalty * seen.to(x.dtype)
    return out.index_copy_(1, tokens, x)


class TokenCounts:
    """One request's counts for the penalties, kept as its output grows: each distinct token seen
    (in the prompt, when the repetition penalty reads it, or in the output) is a column, with how
    often the output holds it. A step's work then grows with the tokens it adds and the distinct
    tokens seen, not with the output's length; a request without penalties keeps none of this."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.params = params
        self.column: dict[int, int] = {}  # token id -> its column
        self.tokens = torch.empty(0, dtype=torch.long)  # [C] each column's token id
        self.output = torch.empty(0, dtype=torch.float32)  # [C] its occurrences in the output
        self.prompt = torch.empty(0, dtype=torch.bool)  # [C] whether the prompt holds it
        self.counted = 0  # output tokens counted so far
        if params.repetition_penalty != 1.0:  # only the repetition penalty reads the prompt
            self._add_columns(prompt_ids, in_prompt=True)

    def count(self, token_ids: Sequence[int], prompt_len: int) -> None:
        """Count the output tokens (``token_ids`` after the first ``prompt_len``) not counted yet."""
        new = list(token_ids[prompt_len + self.counted :])
        self.counted += len(new)
        if new:
            self._add_columns(new, in_prompt=False)
            self.output.index_add_(0, torch.tensor([self.column[t] for t in new]), torch.ones(len(new)))

    def apply(self, logits: Tensor, paths: Sequence[Sequence[int]]) -> Tensor:
        """logits [N, V] -> penalised logits, row n as if ``paths[n]`` (that row's drafts, root
        first) followed the counted output."""
        extra = sorted({t for path in paths for t in path if t not in self.column})
        column = self.column | {t: len(self.column) + j for j, t in enumerate(extra)}
        tokens = torch.cat([self.tokens, torch.tensor(extra, dtype=torch.long)])
        counts = torch.cat([self.output, torch.zeros(len(extra))]).expand(len(paths), -1).clone()  # [N, C]
        rows = [n for n, path in enumerate(paths) for _ in path]
        if rows:
            cols = [column[t] for path in paths for t in path]
            counts.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.ones(len(rows)), accumulate=True)
        in_prompt = torch.cat([self.prompt, torch.zeros(len(extra), dtype=torch.bool)])
        return apply_penalties(logits, self.params, tokens, counts, in_prompt)

    def _add_columns(self, token_ids: Sequence[int], in_prompt: bool) -> None:
        """A column for each token of ``token_ids`` not seen before."""
        fresh = list(dict.fromkeys(t for t in token_ids if t not in self.column))
        if fresh:
            first = len(self.column)
            self.column.update((t, first + j) for j, t in enumerate(fresh))
            self.tokens = torch.cat([self.tokens, torch.tensor(fresh, dtype=torch.long)])
            self.output = torch.cat([self.output, torch.zeros(len(fresh))])
            self.prompt = torch.cat([self.prompt, torch.full((len(fresh),), in_prompt)])
