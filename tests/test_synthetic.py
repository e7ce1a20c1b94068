"""Synthetic acceptance (``--synthetic-acceptance``): drafts kept by a given law, for measuring the
engine apart from the drafter; clearly labelled and never taken for exact output."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.cli import main
from specdecode.config import SpecConfig
from specdecode.sequence import DraftProposal
from specdecode.errors import InvalidConfigError
from specdecode.sample.synthetic import synthetic_length, verify_synthetic
from tests.test_bench import bench, pair_args


def test_lengths_follow_the_law():
    gen = torch.Generator().manual_seed(0)
    lengths = [synthetic_length(4, (0.8,), gen) for _ in range(20000)]
    for i in range(1, 5):  # P(n >= i) = 0.8 ** i
        assert sum(n >= i for n in lengths) / len(lengths) == pytest.approx(0.8 ** i, abs=0.015)
    per_position = [synthetic_length(4, (1.0, 0.5, 0.0), gen) for _ in range(4000)]
    assert set(per_position) == {1, 2} and sum(n == 2 for n in per_position) / 4000 == pytest.approx(0.5, abs=0.03)
    assert synthetic_length(6, (1.0,), gen) == 6 and synthetic_length(6, (0.0,), gen) == 0


def test_the_step_keeps_the_drafts_then_the_targets_token():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate((7, 8, 9, 1)):
        logits[row, best] = 5.0
    proposal = DraftProposal(torch.tensor([2, 3, 4]), None)
    gen = torch.Generator().manual_seed(0)
    all_kept = verify_synthetic(proposal, logits, SamplingParams(temperature=0.0), (1.0,), gen)
    assert all_kept.num_accepted == 3 and all_kept.tokens == [2, 3, 4, 1]  # wrong drafts kept, then row 3's
    none_kept = verify_synthetic(proposal, logits, SamplingParams(temperature=0.0), (0.0,), gen)
    assert none_kept.num_accepted == 0 and none_kept.tokens == [7]
    with pytest.raises(InvalidConfigError, match="chains"):
        verify_synthetic(DraftProposal(torch.tensor([2, 3]), None, parents=(-1, -1)), logits[:3],
                         SamplingParams(temperature=0.0), (1.0,), gen)


def test_rate_zero_is_plain_decoding_and_rate_one_keeps_every_draft(tiny_pair):
    target, draft = tiny_pair
    plain = LLM(model=str(target), max_seq_len=256, progress=False)
    expected = plain.generate([5, 6, 7, 8], SamplingParams(max_tokens=24, temperature=0.0))[0]
    for rates, tau in (((0.0,), 1.0), ((1.0,), 5.0)):
        llm = LLM(model=str(target), draft=str(draft), max_seq_len=256, progress=False, method="draft_model",
                  num_speculative_tokens=4, adaptive=False, draft_confidence=0.0, synthetic_acceptance=rates)
        out = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=24, temperature=0.0))[0]
        assert out.stats.mean_acceptance_length == pytest.approx(tau, abs=0.5), rates
        if rates == (0.0,):  # each step emits the target's own token after the committed context
            assert out.token_ids == expected.token_ids
    with pytest.raises(InvalidConfigError, match="rates in"):
        SpecConfig(synthetic_acceptance=(1.5,))


def test_bench_labels_synthetic_rows_and_gives_no_advice(tiny_pair, tmp_path):
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "none,draft_model", "-k", "4",
                                "--k-schedule", "fixed", "--draft-confidence", "0", "--synthetic-acceptance", "1.0",
                                "--workload", "code", "--limit", "1", "--max-tokens", "16", "--max-seq-len", "512")
    assert code == 0  # forced acceptances change the output, which is no identity failure
    assert set(summary["methods"]) == {"none", "draft_model+synthetic"}
    synthetic = summary["methods"]["draft_model+synthetic"]
    assert synthetic["identical_to_none"] is None and synthetic["mean_acceptance_length"] == pytest.approx(5.0, abs=0.5)
    assert summary["synthetic_acceptance"] == [1.0] and summary["advice"]["best_method"] is None
    assert all(r["synthetic"] == (r["method"] != "none") for r in rows)
    report = (tmp_path / "out" / "summary.md").read_text()
    assert "SYNTHETIC ACCEPTANCE (1)" in report and "--synthetic-acceptance 1.0" in summary["command"]
    code = main(["export", "vllm", "--no-progress", "--from-bench", str(tmp_path / "out"), "--out",
                 str(tmp_path / "export")])
    assert code == 2 and not (tmp_path / "export").exists()


@pytest.mark.parametrize("args, message", [
    (["--synthetic-acceptance", "1.2"], "rates in [0, 1]"),
    (["--synthetic-acceptance", "x"], "rates in [0, 1]"),
    (["--synthetic-acceptance", "0.5", "--peers", "hf"], "peers and --endpoint keep their own"),
    (["--synthetic-acceptance", "0.5", "--methods", "none,tree"], "leave out method tree"),
])
def test_bad_synthetic_options_are_refused(tmp_path, capsys, args, message):
    code = main(["bench", "--no-progress", "--out", str(tmp_path / "o"), "--workload", "code", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
