"""Draft sources (``Drafter.sources``): what a drafter offers the speculation policy each step,
and that the step loop drafts from the source the policy picks and learns under its name."""

from __future__ import annotations

import torch

from specdecode import SamplingParams
from specdecode.drafters.base import Drafter, DraftSource, run_alone
from specdecode.drafters.combined import CombinedDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, match_bucket
from specdecode.sequence import DraftProposal, SequenceState


def _seq(tokens: list[int]) -> SequenceState:
    return SequenceState(list(tokens), len(tokens), SamplingParams())


class _Model(Drafter):
    """Stands in for the draft model: always proposes 7s, at a draft model's cost prior."""

    name = "draft_model"
    draft_cost_prior = 0.4

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return DraftProposal(torch.full((k,), 7, dtype=torch.long), None)


def test_match_buckets_name_copies_by_match_length():
    assert [match_bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [
        "match1", "match1", "match1", "match4", "match4", "match8", "match8", "match16", "match16"]


def test_suffix_offers_its_continuation_under_the_match_length_bucket():
    drafter = SuffixDrafter()
    seq = _seq([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5])
    drafter.begin(seq)
    (source,) = drafter.sources(seq)
    assert source.name == "suffix/match4" and source.cost_prior == 0.0 and source.limit == 7
    assert run_alone(source.draft(seq, 3)).tokens.tolist() == [6, 9, 1]
    assert drafter.sources(_seq([1, 2, 3, 4])) == ()  # no match: nothing to offer


def test_ngram_offers_its_continuation_under_the_match_length_bucket():
    drafter = NgramDrafter()
    seq = _seq([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4])
    drafter.begin(seq)
    (source,) = drafter.sources(seq)
    assert source.name == "ngram/match4" and source.cost_prior == 0.0 and source.acceptance_prior == 0.7
    assert run_alone(source.draft(seq, 3)).tokens.tolist() == [5, 6, 9]
    short = _seq([5, 8, 2, 5])  # only the last token occurred before: a one-token match's weaker bet
    drafter.begin(short)
    (weak,) = drafter.sources(short)
    assert weak.name == "ngram/match1" and weak.acceptance_prior == 0.5
    fresh = _seq([1, 2, 3])
    drafter.begin(fresh)
    assert drafter.sources(fresh) == ()  # no match: a plain step, no verify row spent on a guess


def test_combined_offers_the_copy_first_then_the_draft_model():
    combined = CombinedDrafter(_Model(), SuffixDrafter())
    seq = _seq([5, 6, 7, 8, 5, 6])
    combined.begin(seq)
    copy, model = combined.sources(seq)
    assert (copy.name, model.name) == ("suffix/match1", "draft_model")
    assert run_alone(copy.draft(seq, 2)).tokens.tolist() == [7, 8]
    assert run_alone(model.draft(seq, 2)).tokens.tolist() == [7, 7]
    assert combined.propose(seq, 2).tokens.tolist() == [7, 8]  # alone, the first source drafts
    fresh = _seq([1, 2, 3])
    combined.begin(fresh)
    (only,) = combined.sources(fresh)
    assert only.name == "draft_model" and isinstance(only, DraftSource)


def test_the_step_loop_learns_each_source_apart_and_stays_exact(tiny_pair):
    """A combined request whose prompt repeats itself drafts copies and model drafts; the
    policy learns their acceptance under the sources' names, and the output is plain decoding's."""
    from specdecode import LLM

    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=256, progress=False)
    assert llm.spec.method == "combined"  # the default with a draft model
    prompt = list(b"def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    [plain] = llm.generate([prompt], params, method="none")
    [out] = llm.generate([prompt], params)
    assert out.token_ids == plain.token_ids
    assert 0 < out.stats.free_drafts <= out.stats.drafts  # copies were drafted, and counted
    learned = set(llm.engine.policy.method_acceptance)
    assert any(name.startswith("suffix/match") for name in learned), learned
