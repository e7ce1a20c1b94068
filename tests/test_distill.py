"""DistillSpec: the trainable twin computes what the inference decoder computes, merging keeps
what was learnt, training raises agreement with the target, and the CLI writes a draft folder that
drafts exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode import LLM
from specdecode.cli import main
from specdecode.models.decoder import Decoder
from specdecode.train import distill, loop
from specdecode.train.capture import TrainingSequence, capture
from specdecode.train.loop import LoopConfig
from specdecode.train.student import Student
from tests.conftest import make_tiny_llm, make_tiny_model, make_tiny_tokenizer
from tests.test_lossless import _greedy, _prompt
from tests.test_train import _code_folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A target with sharp next-token choices, and a noisy copy of it as the draft."""
    root = tmp_path_factory.mktemp("distill")
    pair = (make_tiny_llm(root / "target", "qwen2", seed=10, tie_word_embeddings=False),
            make_tiny_llm(root / "draft", "qwen2", seed=10, noise=0.5, tie_word_embeddings=False))
    for folder in pair:
        weights = load_file(str(folder / "model.safetensors"))
        weights["lm_head.weight"] *= 4.0
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return pair


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False)])
def test_student_computes_the_decoders_logits(tmp_path, arch, tied):
    folder = make_tiny_llm(tmp_path / "m", arch, seed=3, tie_word_embeddings=tied)
    student = Student.from_dir(folder, rank=4)
    decoder = Decoder.from_dir(folder, "float32", role="draft")
    tokens = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(student(tokens), decoder.forward(tokens, decoder.new_cache(64)), atol=1e-4)
    assert student.state_dict().keys() == {n for n, p in student.named_parameters()}  # only the adapters


def test_merged_weights_keep_what_the_adapters_learnt(pair):
    student = Student.from_dir(pair[1], rank=4)
    with torch.no_grad():
        for p in student.parameters():
            p.normal_(0, 0.05)  # adapters away from their zero start
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    merged = distill.merged_decoder(student, None)
    with torch.no_grad():
        base = Decoder.from_dir(pair[1], "float32", role="draft").forward(tokens, merged.new_cache(64))
        want = student(tokens)
    got = merged.forward(tokens, merged.new_cache(64))
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(base, want, atol=1e-2)  # the adapters did change the model


def test_training_raises_agreement_with_the_target(pair, tmp_path):
    llm = LLM(model=str(pair[0]), draft=str(pair[1]), max_seq_len=512, progress=False)
    respond = distill.draft_responses(llm.draft_model, llm.tokenizer, 60, 1.0, seed=0)
    g = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(40):
        prompt = torch.randint(0, 256, (8,), generator=g).tolist()
        examples.append(capture(llm.target, TrainingSequence(prompt + respond(prompt), len(prompt)), ()))
    train, val = examples[:32], examples[32:]
    student = Student.from_dir(pair[1], rank=8)
    with torch.no_grad():
        before_loss = sum(distill.loss(student, ex).item() for ex in train)
    before = distill.evaluate(student, val)
    loop.run(student, train, lambda ex: distill.loss(student, ex), lambda: distill.evaluate(student, val), tmp_path,
             LoopConfig(lr=1e-3, max_steps=100, eval_every=100, warmup_steps=5), progress=False)
    after = distill.evaluate(student, val)
    with torch.no_grad():
        assert sum(distill.loss(student, ex).item() for ex in train) < 0.9 * before_loss
    assert after["agree"] > before["agree"] and after["accept"] > before["accept"]
    quantized = distill.quantized_acceptance(distill.merged_decoder(student, "int8"), val)
    assert quantized["agree"] > before["agree"]  # the gain survives quantization


def test_cli_writes_a_draft_that_drafts_exactly(pair, tmp_path, capsys):
    target, draft = pair
    data, out = _code_folder(tmp_path / "src"), tmp_path / "distilled"
    argv = ["train", "distill", "--model", str(target), "--draft", str(draft), "--data", str(data), "--out",
            str(out), "--max-steps", "8", "--max-sequences", "12", "--max-new-tokens", "40", "--lora-rank", "4",
            "--eval-every", "4", "--no-progress"]
    assert main(argv) == 0
    assert "greedy agreement" in capsys.readouterr().out
    record = json.loads((out / "train.json").read_text())
    assert record["steps"] == 8 and record["data"]["responses"] == "draft"
    assert set(record["quantized"]) == {"mode", "untrained", "trained"} and record["untrained"]["positions"] > 0
    card = (out / "README.md").read_text()
    assert str(target) in card and record["quantized"]["mode"] in card
    config = json.loads((out / "config.json").read_text())
    assert config["specdecode"]["target"] == str(target)

    llm = LLM(model=str(target), draft=str(out), max_seq_len=512, progress=False)
    for seed in range(3):
        plain = llm.generate(_prompt(seed), _greedy(), method="none")[0]
        spec = llm.generate(_prompt(seed), _greedy(), method="draft_model", num_speculative_tokens=4)[0]
        assert spec.token_ids == plain.token_ids

    assert main(argv[:-1] + ["--resume", "--max-steps", "10", "--no-progress"]) == 0
    assert json.loads((out / "train.json").read_text())["steps"] == 10
    assert "reusing" in capsys.readouterr().err


def test_cli_refuses_a_draft_with_another_vocabulary(pair, tmp_path, capsys):
    foreign = make_tiny_model(tmp_path / "foreign", "qwen2", vocab_size=300, seed=4)
    make_tiny_tokenizer(foreign)  # the same bytes, but 300 rows: drafts would go through text
    data = _code_folder(tmp_path / "src")
    code = main(["train", "distill", "--model", str(pair[0]), "--draft", str(foreign), "--data", str(data),
                 "--out", str(tmp_path / "o"), "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "vocabulary" in err and "Traceback" not in err


@pytest.mark.parametrize("extra,message", [(["--lora-rank", "0"], "--lora-rank"),
                                           (["--temperature", "-1"], "--temperature")])
def test_cli_bad_settings_are_one_line(pair, tmp_path, capsys, extra, message):
    code = main(["train", "distill", "--model", str(pair[0]), "--draft", str(pair[1]), "--data", str(tmp_path),
                 "--out", str(tmp_path / "o"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
