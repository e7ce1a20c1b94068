"""``specdecode export vllm``: the folder's shape and fields, checked against vLLM 0.32's documented
schema without vLLM installed; refusals of methods vLLM lacks; serve.sh's command line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdecode.cli import main
from specdecode.errors import InvalidConfigError
from specdecode.export.plan import plan_export
from specdecode.export.choices import NEAREST
from specdecode.export.vllm import speculative_config
from specdecode.heads.eagle3_format import load_eagle3, save_eagle3
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.heads.medusa_format import load_medusa, save_medusa
from specdecode.models.config import ModelConfig, config_fingerprint
from tests.conftest import make_tiny_llm
from tests.test_cross_vocab import make_merged_tokenizer
from tests.test_eagle import random_head

# vLLM 0.32's SpeculativeConfig fields and methods that an export may use (vllm/config/speculative.py).
VLLM_SPEC_FIELDS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "use_heterogeneous_vocab", "draft_tensor_parallel_size"}
VLLM_METHODS = {"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3"}


def export(tmp_path: Path, *args: str, out: str = "export") -> tuple[int, Path]:
    folder = tmp_path / out
    return main(["export", "vllm", "--no-progress", "--out", str(folder), *args]), folder


def test_a_draft_model_export_holds_what_vllm_serve_reads(tiny_pair, tmp_path):
    target, draft = tiny_pair
    code, out = export(tmp_path, "--model", str(target), "--draft", str(draft), "-k", "3")
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "draft", "export.json", "serve.sh",
                                                      "speculative_config.json", "target"]
    config = json.loads((out / "speculative_config.json").read_text())
    assert config == {"method": "draft_model", "num_speculative_tokens": 3, "model": "./draft"}
    assert set(config) <= VLLM_SPEC_FIELDS and config["method"] in VLLM_METHODS
    for name, source in (("target", target), ("draft", draft)):
        folder = out / name
        for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
            assert (folder / file).is_file(), (name, file)
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
        ours, theirs = load_file(source / "model.safetensors"), load_file(folder / "model.safetensors")
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        linked = folder / "model.safetensors"
        assert linked.stat().st_ino == (source / "model.safetensors").stat().st_ino  # no second copy
        assert not linked.stat().st_mode & 0o222  # read-only: an in-place edit would reach the cache
    record = json.loads((out / "export.json").read_text())
    assert record["method"] == "draft_model" and record["k"] == 3 and record["speculative_config"] == config
    assert record["serve"][:3] == ["vllm", "serve", "./target"] and record["vllm_version"] == "0.32.0"
    assert "specdecode export vllm" in (out / "README.md").read_text()


def test_serve_sh_runs_vllm_from_its_folder_and_passes_flags_through(tiny_pair, tmp_path):
    target, draft = tiny_pair
    code, out = export(tmp_path, "--model", str(target), "--draft", str(draft), "-k", "3",
                       "--tensor-parallel-size", "2")
    assert code == 0
    script = out / "serve.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    fake = tmp_path / "fake-python"  # records its argv and working folder instead of starting vLLM
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd()}))\n")
    fake.chmod(0o755)
    done = subprocess.run([str(script), "--port", "8123", "--tensor-parallel-size", "4"], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": str(fake)}, check=True, cwd=tmp_path)
    seen = json.loads(done.stdout)
    argv = seen["argv"]
    assert Path(seen["cwd"]) == out.resolve()
    assert argv[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "./target"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == json.loads(
        (out / "speculative_config.json").read_text())
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"  # the export's own
    assert argv[-4:] == ["--port", "8123", "--tensor-parallel-size", "4"]  # later flags win in vLLM's parser
    assert argv[argv.index("--dtype") + 1] == "float32"


def test_ngram_and_plain_exports(tiny_pair, tmp_path):
    target, _ = tiny_pair
    code, out = export(tmp_path, "--model", str(target), "--method", "ngram", out="ngram")
    assert code == 0
    config = json.loads((out / "speculative_config.json").read_text())
    assert config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 4}
    assert not (out / "draft").exists()
    code, out = export(tmp_path, "--model", str(target), "--method", "none", out="plain")
    assert code == 0 and not (out / "speculative_config.json").exists()
    assert "--speculative-config" not in (out / "serve.sh").read_text()


def test_bfloat16_export_casts_the_weights(tiny_pair, tmp_path):
    target, _ = tiny_pair
    code, out = export(tmp_path, "--model", str(target), "--method", "ngram", "--dtype", "bfloat16")
    assert code == 0
    weights = load_file(out / "target" / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    source = load_file(target / "model.safetensors")
    assert all(torch.equal(weights[k], source[k].to(torch.bfloat16)) for k in source)
    assert "--dtype bfloat16" in (out / "serve.sh").read_text()


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("exp-eagle") / "target", "qwen2", seed=10,
                         tie_word_embeddings=False, num_hidden_layers=8)


def test_an_eagle_head_is_exported_in_the_speculators_format(eagle_target, tmp_path):
    cfg = ModelConfig.from_dir(eagle_target)
    head = random_head(cfg)
    source = save_eagle3(head, tmp_path / "head", target_name="tiny", target_fingerprint=config_fingerprint(eagle_target))
    code, out = export(tmp_path, "--model", str(eagle_target), "--eagle-head", str(source), "-k", "4")
    assert code == 0
    assert json.loads((out / "speculative_config.json").read_text()) == {
        "method": "eagle3", "num_speculative_tokens": 4, "model": "./eagle3"}
    config = json.loads((out / "eagle3" / "config.json").read_text())
    # What vLLM's SpeculatorsConfig requires (vllm/transformers_utils/configs/speculators/).
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"] == "./target"
    assert isinstance(config["transformer_layer_config"], dict)
    assert config["norm_before_residual"] is False  # vLLM reads a missing flag as True
    weights = load_file(out / "eagle3" / "model.safetensors")
    assert any(k.startswith("layers.0.") for k in weights) and not any(k.startswith("midlayer.") for k in weights)
    assert "d2t" in weights and "embed_tokens.weight" not in weights  # vLLM shares the target's embedding
    back, _ = load_eagle3(out / "eagle3")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


def test_medusa_heads_are_exported_with_k_equal_to_their_number(tiny_pair, tmp_path):
    target, _ = tiny_pair
    cfg = ModelConfig.from_dir(target)
    heads = MedusaHeads(MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads=3, truncated_vocab_size=100))
    source = save_medusa(heads, tmp_path / "heads", target_name="tiny", target_fingerprint=config_fingerprint(target))
    code, out = export(tmp_path, "--model", str(target), "--medusa-heads", str(source))
    assert code == 0
    assert json.loads((out / "speculative_config.json").read_text()) == {
        "method": "medusa", "num_speculative_tokens": 3, "model": "./medusa"}
    config = json.loads((out / "medusa" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["truncated_vocab_size"] == 100
    assert config["medusa_fc_bias"] is True and "token_map" in load_file(out / "medusa" / "model.safetensors")
    back, _ = load_medusa(out / "medusa")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in heads.state_dict().items())
    with pytest.raises(InvalidConfigError, match="vLLM builds exactly K heads"):
        plan_export(model=str(target), method=None, draft=None, eagle_head=None, medusa_heads=str(source), k=4,
                    from_bench=None, dtype=None, tensor_parallel_size=1, progress=False)


def test_a_draft_of_another_vocabulary_uses_vllms_heterogeneous_vocab(tiny_pair, tmp_path):
    from tests.conftest import make_tiny_model

    target, _ = tiny_pair
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=300, seed=3, tie_word_embeddings=False)
    make_merged_tokenizer(other)
    plan = plan_export(model=str(target), method=None, draft=str(other), eagle_head=None, medusa_heads=None, k=4,
                       from_bench=None, dtype=None, tensor_parallel_size=1, progress=False)
    assert plan.heterogeneous_vocab and speculative_config(plan)["use_heterogeneous_vocab"] is True


def test_k_and_method_come_from_a_bench_runs_advice(tiny_pair, tmp_path):
    target, _ = tiny_pair
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "summary.json").write_text(json.dumps({
        "model": str(target), "draft": None, "created": "2026-11-24", "settings": {"k_schedule": "fixed"},
        "advice": {"best_method": "ngram", "per_method": {"ngram": {"best_k": 6}}}}))
    code, out = export(tmp_path, "--from-bench", str(bench_dir))
    assert code == 0
    assert json.loads((out / "speculative_config.json").read_text())["num_speculative_tokens"] == 6
    assert "the best K for ngram in the bench run" in (out / "README.md").read_text()
    with pytest.raises(InvalidConfigError, match="did not run there"):
        plan_export(model=None, method="draft_model", draft=None, eagle_head=None, medusa_heads=None, k=None,
                    from_bench=bench_dir, dtype=None, tensor_parallel_size=1, progress=False)


@pytest.mark.parametrize("method", sorted(NEAREST))
def test_methods_vllm_lacks_are_refused_with_the_nearest_named(tiny_pair, tmp_path, capsys, method):
    target, draft = tiny_pair
    code, out = export(tmp_path, "--model", str(target), "--draft", str(draft), "--method", method)
    err = capsys.readouterr().err
    assert code == 2 and f"vLLM has no counterpart of method {method!r}; the nearest is" in err
    assert "Traceback" not in err and not out.exists()


def test_a_bench_without_advice_or_a_bad_head_writes_nothing(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "summary.json").write_text(json.dumps({"advice": {"best_method": None, "reason": "no baseline"}}))
    code, out = export(tmp_path, "--model", str(target), "--from-bench", str(bench_dir))
    assert code == 2 and "names no method (no baseline)" in capsys.readouterr().err and not out.exists()
    wrong = save_eagle3(random_head(ModelConfig.from_dir(make_tiny_llm(tmp_path / "other", "qwen2", num_hidden_layers=8))),
                        tmp_path / "head", target_name="other", target_fingerprint="0123456789abcdef")
    code, out = export(tmp_path, "--model", str(target), "--eagle-head", str(wrong), out="eagle")
    assert code == 2 and "does not fit this target" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--method", "ngram", "--draft", "x"], "--draft applies to method draft_model"),
    (["--method", "eagle"], "needs --eagle-head"),
    (["--method", "ngram", "-k", "0"], "-k must be in [1, 32]"),
    (["--method", "ngram", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--from-bench", "/no/such/bench"], "no summary.json"),
])
def test_bad_export_options_are_one_line_errors(tiny_pair, tmp_path, capsys, args, message):
    code, _ = export(tmp_path, "--model", str(tiny_pair[0]), *args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_an_out_folder_that_is_not_an_export_is_left_alone(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "export.json").write_text('{"name": "some other tool"}')  # a file of that name is not enough
    code = main(["export", "vllm", "--no-progress", "--model", str(target), "--method", "ngram", "--out", str(mine)])
    assert code == 2 and "is not an earlier export" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"
    code, out = export(tmp_path, "--model", str(target), "--method", "ngram", "-k", "2", out="again")
    assert code == 0
    code, out = export(tmp_path, "--model", str(target), "--method", "ngram", "-k", "7", out="again")
    assert code == 0  # an earlier export is replaced whole
    assert json.loads((out / "speculative_config.json").read_text())["num_speculative_tokens"] == 7
