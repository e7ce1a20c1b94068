"""Medusa heads: vLLM's layout and FasterDecoding's, training, exact drafting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode import LLM, Constraint, SamplingParams
from specdecode.cli import main
from specdecode.errors import HeadMismatchError, InvalidConfigError
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.heads.medusa_format import load_medusa, save_medusa
from specdecode.models.config import config_fingerprint
from specdecode.train import loop, medusa
from specdecode.train.capture import draft_vocabulary
from tests.test_lossless import _greedy, _prompt
from tests.test_sampling_lossless import _prompt_with_likely_continuations, assert_sampled_joint_is_exact
from tests.test_train import _code_folder, greedy_examples, sharp_target

VOCAB = 128


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A sharp tiny target, and heads trained on its greedy output (with the validation of
    untrained heads and of the trained ones)."""
    root = tmp_path_factory.mktemp("medusa")
    target = sharp_target(root / "target")
    llm = LLM(model=str(target), max_seq_len=300, progress=False)
    examples = greedy_examples(llm, (llm.target.config.num_layers,), 120)
    train, val = examples[:100], examples[100:]
    cfg = MedusaConfig(llm.target.config.hidden_size, llm.target.config.vocab_size, num_heads=3,
                       truncated_vocab_size=VOCAB)
    vocabulary = draft_vocabulary(train, VOCAB, cfg.vocab_size)
    norm = medusa.TargetNorm(llm.target)
    torch.manual_seed(0)
    untrained = MedusaHeads(cfg)  # the default init: no start from the target's LM head
    untrained.set_vocabulary(vocabulary)
    before = medusa.evaluate(untrained, val, norm)
    heads = medusa.new_heads(llm.target, cfg, vocabulary)
    first = medusa.loss(heads, train[0], norm).item()
    state = loop.run(heads, train, lambda ex: medusa.loss(heads, ex, norm), lambda: medusa.evaluate(heads, val, norm),
                     root / "run", loop.LoopConfig(lr=3e-3, max_steps=300, eval_every=300), progress=False)
    folder = save_medusa(heads, root / "heads", target_name="tiny", target_fingerprint=config_fingerprint(target))
    return target, folder, {"before": before, "after": state.history[-1], "first_loss": first}


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    _, _, m = trained
    assert m["after"]["loss"] < m["first_loss"]
    assert m["after"]["tau"] > m["before"]["tau"] + 0.3, m


def test_vllm_layout_round_trip(trained):
    _, folder, _ = trained
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["truncated_vocab_size"]) == (3, 1, VOCAB)
    assert config["medusa_fc_bias"] is True
    keys = set(load_file(str(folder / "model.safetensors")))
    assert keys == {"token_map", *(f"blocks.{k}.layers.0.{p}" for k in range(3) for p in ("weight", "bias")),
                    *(f"lm_heads.{k}.weight" for k in range(3))}
    heads, ours = load_medusa(folder)
    assert ours["target"] == "tiny" and heads.config.draft_vocab_size == VOCAB


def test_fasterdecoding_checkpoints_load(tmp_path):
    """The original Medusa layout (``{k}.{j}.linear.*``, ``{k}.{L}.weight``, medusa_num_heads)."""
    cfg = MedusaConfig(hidden_size=16, vocab_size=40, num_heads=2)
    heads = MedusaHeads(cfg)
    weights = {}
    for k in range(2):
        weights[f"{k}.0.linear.weight"] = heads.blocks[k].layers[0].weight.detach().clone()
        weights[f"{k}.0.linear.bias"] = torch.randn(16)
        weights[f"{k}.1.weight"] = heads.lm_heads[k].weight.detach().clone()
    folder = tmp_path / "orig"
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                    "hidden_size": 16, "vocab_size": 40}))
    loaded, _ = load_medusa(folder)
    assert torch.equal(loaded.blocks[1].layers[0].bias, weights["1.0.linear.bias"])
    assert torch.equal(loaded.lm_heads[0].weight, weights["0.1.weight"])
    assert torch.equal(loaded.target_ids, torch.arange(40))


@pytest.mark.parametrize("tree_width", [0, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identity(trained, k, tree_width):
    target, folder, _ = trained
    llm = LLM(model=str(target), medusa_heads=str(folder), max_seq_len=300, progress=False,
              head_tree_width=tree_width)
    drafted = accepted = 0
    for seed in range(4):
        plain = llm.generate(_prompt(seed), _greedy(), method="none")[0]
        spec = llm.generate(_prompt(seed), _greedy(), method="medusa", num_speculative_tokens=k)[0]
        assert spec.token_ids == plain.token_ids, (k, tree_width, seed)
        drafted, accepted = drafted + spec.stats.draft_tokens, accepted + spec.stats.accepted_tokens
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("tree_width", [0, 2], ids=["chain", "tree"])
def test_sampled_tokens_follow_the_exact_target_distribution(trained, tree_width):
    target, folder, _ = trained
    llm = LLM(model=str(target), medusa_heads=str(folder), max_seq_len=300, progress=False,
              head_tree_width=tree_width)
    ids = _prompt_with_likely_continuations(llm, SamplingParams(max_tokens=3, temperature=1.0, top_k=3))
    assert_sampled_joint_is_exact(llm, ids, lambda: llm.new_drafter("medusa"), k=2 if not tree_width else 4)


def test_heads_for_another_target_are_refused(trained, tmp_path):
    target, folder, _ = trained
    config = json.loads((folder / "config.json").read_text())
    config["specdecode"]["target_fingerprint"] = "0" * 16
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(HeadMismatchError, match="trained for tiny"):
        LLM(model=str(target), medusa_heads=str(other), max_seq_len=64, progress=False)
    with pytest.raises(InvalidConfigError, match="medusa_heads"):
        LLM(model=str(target), max_seq_len=64, progress=False).generate("x", _greedy(2), method="medusa")


def test_cli_trains_heads(trained, tmp_path, capsys):
    target, _, _ = trained
    out = tmp_path / "heads"
    assert main(["train", "medusa", "--model", str(target), "--data", str(_code_folder(tmp_path / "src")),
                 "--out", str(out), "--max-steps", "10", "--num-heads", "2", "--vocab-size", "64",
                 "--piece-tokens", "64", "--no-progress"]) == 0
    heads, ours = load_medusa(out)
    assert heads.config.num_heads == 2 and ours["training"]["steps"] == 10
    assert "Medusa heads" in (out / "README.md").read_text()


def test_batched_requests_get_their_solo_output(trained):
    from specdecode.server.scheduler import Scheduler
    from tests.conftest import spec_k
    from tests.test_scheduler import _prompts, _run_concurrently

    target, folder, _ = trained
    llm = LLM(model=str(target), medusa_heads=str(folder), max_seq_len=300, progress=False)
    prompts = _prompts(llm, 5)
    params = [SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True) for i in range(5)]
    solo = [llm.engine.generate(p, q, llm.drafter("medusa"), spec_k(3)) for p, q in zip(prompts, params)]
    results = _run_concurrently(Scheduler(llm, method="medusa", k=3, max_concurrency=3, max_queue=8), prompts,
                                params)
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]


@pytest.mark.parametrize("tree_width", [0, 2], ids=["chain", "tree"])
def test_greedy_identity_under_a_grammar(trained, tree_width):
    target, folder, _ = trained
    llm = LLM(model=str(target), medusa_heads=str(folder), max_seq_len=300, progress=False,
              head_tree_width=tree_width)
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=Constraint("regex", r"[a-z =]{1,30}\."))
    for seed in range(3):
        plain = llm.generate(_prompt(seed), params, method="none")[0]
        spec = llm.generate(_prompt(seed), params, method="medusa", num_speculative_tokens=4)[0]
        assert spec.token_ids == plain.token_ids, (tree_width, seed)
