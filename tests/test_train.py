"""Training drafters: the loss falls and acceptance rises, checkpoints survive kills, the CLI
writes a head that drafts exactly, and bad input is a named error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode import LLM, SamplingParams
from specdecode.cli import main
from specdecode.errors import CheckpointError, InvalidConfigError
from specdecode.heads.eagle3 import Eagle3Config, Eagle3Head
from specdecode.heads.eagle3_format import load_eagle3
from specdecode.train import eagle3, loop
from specdecode.train.capture import Example, TrainingSequence, capture, draft_vocabulary
from specdecode.train.loop import LoopConfig
from tests.conftest import make_tiny_llm
from tests.test_lossless import _greedy, _prompt

STEPS = 4  # unrolled draft steps in these tests


def sharp_target(path: Path) -> Path:
    """A tiny 8-layer target with a sharpened LM head, so its next-token choices are learnable."""
    make_tiny_llm(path, "qwen2", seed=10, tie_word_embeddings=False, num_hidden_layers=8)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] *= 4.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def greedy_examples(llm: LLM, layers, count: int, seed: int = 0) -> list[Example]:
    """The target's own greedy continuations of random byte prompts, captured."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (8,), generator=g).tolist() for _ in range(count)]
    answers = llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True), method="none", max_batch=200)
    return [capture(llm.target, TrainingSequence(prompt + answer.token_ids, len(prompt)), layers)
            for prompt, answer in zip(prompts, answers)]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return sharp_target(tmp_path_factory.mktemp("train") / "target")


@pytest.fixture(scope="module")
def llm(target) -> LLM:
    return LLM(model=str(target), max_seq_len=512, progress=False)


@pytest.fixture(scope="module")
def head_config(llm) -> Eagle3Config:
    return Eagle3Config.for_target(llm.target.config, draft_vocab_size=128, intermediate_size=96)


@pytest.fixture(scope="module")
def examples(llm, head_config) -> list[Example]:
    return greedy_examples(llm, head_config.hidden_layers, 200)


def test_capture_keeps_states_distribution_and_mask(llm, head_config):
    seq = TrainingSequence(list(range(20, 60)), prompt_len=10)
    ex = capture(llm.target, seq, head_config.hidden_layers)
    logits = llm.target.forward(torch.tensor(seq.token_ids), llm.target.new_cache(64))
    assert ex.states.shape == (40, 3 * llm.target.config.hidden_size) and ex.states.dtype == torch.bfloat16
    assert torch.equal(ex.top_ids[:, 0], logits.argmax(-1))
    torch.testing.assert_close(ex.top_logp[:, 0], torch.log_softmax(logits, -1).max(-1).values)
    assert ex.loss_mask.tolist() == [False] * 9 + [True] * 31  # from the prompt's last position


def test_training_lowers_the_loss_and_raises_acceptance(llm, head_config, examples, tmp_path):
    train, val = examples[:180], examples[180:]
    embed = llm.target.embed_tokens
    vocabulary = draft_vocabulary(train, head_config.draft_vocab_size, head_config.vocab_size)
    torch.manual_seed(0)
    untrained = Eagle3Head(head_config)
    untrained.set_vocabulary(vocabulary)
    before = eagle3.evaluate(untrained, val, embed, STEPS)
    head = eagle3.new_head(llm.target, head_config, vocabulary)
    first_loss = eagle3.loss(head, train[0], embed, STEPS).item()
    state = loop.run(head, train, lambda ex: eagle3.loss(head, ex, embed, STEPS),
                     lambda: eagle3.evaluate(head, val, embed, STEPS), tmp_path,
                     LoopConfig(lr=1e-3, max_steps=400, eval_every=200), progress=False)
    after = state.history[-1]
    assert after["step"] == 400 and after["loss"] < first_loss
    assert after["tau"] > before["tau"] + 0.5, (before, after)
    assert after["accept"][0] > before["accept"][0] + 0.2


def _run(tmp_path, train, head, embed, steps, **cfg):
    return loop.run(head, train, lambda ex: eagle3.loss(head, ex, embed, STEPS),
                    lambda: {"tau": 0.0}, tmp_path, LoopConfig(lr=1e-3, max_steps=steps, eval_every=1000,
                                                                 checkpoint_every_s=0.0, **cfg), progress=False)


def test_resume_after_a_kill_continues_from_the_last_checkpoint(llm, head_config, examples, tmp_path):
    """A run killed at step 9 resumes from its checkpoint and ends with the weights of a run
    that was never interrupted."""
    train, embed = examples[:20], llm.target.embed_tokens
    vocabulary = draft_vocabulary(train, head_config.draft_vocab_size, head_config.vocab_size)
    whole = eagle3.new_head(llm.target, head_config, vocabulary)
    _run(tmp_path / "whole", train, whole, embed, 12)

    killed = eagle3.new_head(llm.target, head_config, vocabulary)
    calls = 0

    def dies_at_nine(ex: Example) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 9:
            raise KeyboardInterrupt
        return eagle3.loss(killed, ex, embed, STEPS)

    with pytest.raises(KeyboardInterrupt):
        loop.run(killed, train, dies_at_nine, lambda: {}, tmp_path / "run",
                 LoopConfig(lr=1e-3, max_steps=12, eval_every=1000, checkpoint_every_s=0.0), progress=False)
    resumed = eagle3.new_head(llm.target, head_config, vocabulary, seed=99)  # other weights: all must come back
    state = loop.run(resumed, train, lambda ex: eagle3.loss(resumed, ex, embed, STEPS), lambda: {},
                     tmp_path / "run", LoopConfig(lr=1e-3, max_steps=12, eval_every=1000, checkpoint_every_s=0.0),
                     resume=True, progress=False)
    assert state.step == 12
    for name, tensor in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, msg=name)


def test_a_kill_while_writing_a_checkpoint_keeps_the_last_good_one(llm, head_config, examples, tmp_path,
                                                                   monkeypatch):
    train, embed = examples[:5], llm.target.embed_tokens
    vocabulary = draft_vocabulary(train, head_config.draft_vocab_size, head_config.vocab_size)
    head = eagle3.new_head(llm.target, head_config, vocabulary)
    _run(tmp_path, train, head, embed, 3)
    saved = torch.load(tmp_path / loop.CHECKPOINT_DIR / loop.STATE_FILE, weights_only=True)
    real_save = torch.save

    def dies_half_way(obj, path):
        Path(path).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        loop.run(head, train, lambda ex: eagle3.loss(head, ex, embed, STEPS), lambda: {}, tmp_path,
                 LoopConfig(lr=1e-3, max_steps=5, eval_every=1000, checkpoint_every_s=0.0), resume=True,
                 progress=False)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == [loop.CHECKPOINT_DIR]  # no partial left behind
    kept = torch.load(tmp_path / loop.CHECKPOINT_DIR / loop.STATE_FILE, weights_only=True)
    assert kept["step"] == saved["step"] == 3


def test_resume_without_a_checkpoint_is_a_named_error(llm, head_config, examples, tmp_path):
    head = Eagle3Head(head_config)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        loop.run(head, examples[:2], lambda ex: eagle3.loss(head, ex, llm.target.embed_tokens, STEPS), lambda: {},
                 tmp_path, LoopConfig(max_steps=1), resume=True, progress=False)


def _code_folder(root: Path) -> Path:
    root.mkdir()
    for i in range(30):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(8))
        (root / f"mod{i}.py").write_text(body)
    (root / "blob.bin").write_bytes(bytes(range(256)))  # skipped: not a text file
    return root


def test_cli_trains_a_head_that_drafts_exactly(target, tmp_path, capsys):
    data, out = _code_folder(tmp_path / "src"), tmp_path / "head"
    argv = ["train", "eagle3", "--model", str(target), "--data", str(data), "--out", str(out), "--max-steps", "30",
            "--draft-vocab-size", "64", "--intermediate-size", "64", "--ttt-steps", "3", "--piece-tokens", "64",
            "--eval-every", "10", "--no-progress"]
    assert main(argv) == 0
    assert "validation tau" in capsys.readouterr().out
    head, ours = load_eagle3(out)
    assert head.config.draft_vocab_size == 64 and ours["training"]["steps"] == 30
    card = (out / "README.md").read_text()
    assert str(target) in card and "tau" in card and "sequences" in card
    record = json.loads((out / "train.json").read_text())
    assert record["data"]["sequences"] > 10 and len(record["history"]) == 3

    llm = LLM(model=str(target), eagle_head=str(out), max_seq_len=512, progress=False)
    for seed in range(3):
        plain = llm.generate(_prompt(seed), _greedy(), method="none")[0]
        spec = llm.generate(_prompt(seed), _greedy(), method="eagle", num_speculative_tokens=4)[0]
        assert spec.token_ids == plain.token_ids

    assert main(argv) == 2  # the run exists: continuing needs --resume
    assert "--resume" in capsys.readouterr().err
    assert main(argv[:-1] + ["--resume", "--max-steps", "40", "--no-progress"]) == 0
    assert json.loads((out / "train.json").read_text())["steps"] == 40
    assert "reusing" in capsys.readouterr().err  # the captured data was not captured again


@pytest.mark.parametrize("extra,message", [
    (["--data", "/nonexistent/folder"], "no such file or folder"),
    (["--max-steps", "0"], "at least 1"),
    (["--val-fraction", "0.9"], "val-fraction"),
])
def test_cli_bad_input_is_one_line(target, tmp_path, capsys, extra, message):
    argv = ["train", "eagle3", "--model", str(target), "--data", str(_code_folder(tmp_path / "src")),
            "--out", str(tmp_path / "out"), "--no-progress", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_empty_data_is_a_clear_error(target, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "eagle3", "--model", str(target), "--data", str(empty), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    assert "no usable text" in capsys.readouterr().err


@pytest.mark.parametrize("data, message", [("/dev/zero", "not a regular file or folder"),
                                           ("NUL", "NUL bytes"), ("BINARY", "not UTF-8 text")])
def test_cli_data_that_is_not_text_is_a_clear_error(target, tmp_path, capsys, data, message):
    files = {"NUL": b"abc\x00def\n", "BINARY": b"\x89PNG\r\n\x1a\n\xff\xfe"}
    if data in files:
        (tmp_path / data).write_bytes(files[data])
        data = str(tmp_path / data)
    assert main(["train", "eagle3", "--model", str(target), "--data", data, "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_jsonl_prompts_are_answered_by_the_target(llm, tmp_path):
    from specdecode.train.data import DataConfig, load_sequences

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "x", "response": "yz"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                 "content": "ans"}]}) + "\n")
    answered = []

    def respond(ids):
        answered.append(ids)
        return [1, 2, 3]

    train, val = load_sequences([path], llm.tokenizer, DataConfig(val_fraction=0.0), respond)
    assert len(train) == 3 and not val and len(answered) == 1
    tails = sorted(tuple(s.token_ids[s.prompt_len :]) for s in train)
    assert tails == sorted([(1, 2, 3), tuple(llm.tokenizer.encode("yz")), tuple(llm.tokenizer.encode("ans"))])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\"nothing\": 1}\n")
    with pytest.raises(InvalidConfigError, match="line 1"):
        load_sequences([bad], llm.tokenizer, DataConfig(), respond)
