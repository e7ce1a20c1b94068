"""EAGLE-3 heads: shapes, both checkpoint layouts, drafting that matches training, exactness."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode import LLM, Constraint, SamplingParams
from specdecode.sequence import SequenceState
from specdecode.drafters.eagle import EagleDrafter
from specdecode.engine.generation import GenerationOutput
from specdecode.errors import CheckpointError, HeadMismatchError, InvalidConfigError, UnsupportedModelError
from specdecode.heads.eagle3 import Eagle3Config, Eagle3Head, default_hidden_layers
from specdecode.heads.eagle3_format import load_eagle3, save_eagle3
from specdecode.models.config import ModelConfig, config_fingerprint
from specdecode.models.decoder import Decoder, HiddenCapture
from tests.conftest import make_tiny_llm
from tests.test_lossless import _greedy, _prompt
from tests.test_sampling_lossless import _prompt_with_likely_continuations, assert_sampled_joint_is_exact
from tests.test_train import greedy_examples, sharp_target

DRAFT_VOCAB = 128
SPECFORGE_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{name}.weight" for name in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny target deep enough for the default layers (2, L/2, L-3) to be distinct."""
    return make_tiny_llm(tmp_path_factory.mktemp("eagle") / "target", "qwen2", seed=10, tie_word_embeddings=False,
                         num_hidden_layers=8)


def random_head(target: ModelConfig, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=DRAFT_VOCAB, intermediate_size=96))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # sharper than the default init: varied, confident drafts
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
    head.set_vocabulary(ids.sort().values)
    return head


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory) -> Path:
    cfg = ModelConfig.from_dir(target_dir)
    return save_eagle3(random_head(cfg), tmp_path_factory.mktemp("heads") / "head", target_name="tiny",
                       target_fingerprint=config_fingerprint(target_dir))


@pytest.fixture(scope="module")
def llms(target_dir, head_dir) -> dict[int, LLM]:
    """By tree width (0: chain)."""
    return {w: LLM(model=str(target_dir), eagle_head=str(head_dir), max_seq_len=512, progress=False,
                   head_tree_width=w) for w in (0, 3)}


@pytest.fixture(scope="module")
def plain(llms) -> Callable[[int, int], GenerationOutput]:
    """Plain greedy decoding of ``_prompt(seed)`` by ``llms[tree_width]``, once each."""
    return functools.cache(lambda width, seed: llms[width].generate(_prompt(seed), _greedy(), method="none")[0])


def test_head_shapes_follow_the_target():
    target = ModelConfig(architecture="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_layers=28, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
                         attention_bias=True)
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=300, intermediate_size=80))
    assert head.config.hidden_layers == (2, 14, 25) == default_hidden_layers(28)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes["fc.weight"] == (64, 3 * 64)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (64, 128)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (32, 128)
    assert shapes["midlayer.mlp.down_proj.weight"] == (64, 80)
    assert shapes["lm_head.weight"] == (300, 64)
    assert shapes["d2t"] == (300,) and head.d2t.dtype == torch.int64
    assert shapes["t2d"] == (1000,) and head.t2d.dtype == torch.bool
    assert set(shapes) == SPECFORGE_KEYS


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_save_load_round_trip(target_dir, tmp_path, layout):
    cfg = ModelConfig.from_dir(target_dir)
    head = random_head(cfg, seed=1)
    folder = save_eagle3(head, tmp_path / layout, layout, target_name="org/tiny", target_architecture="qwen2",
                         target_fingerprint="abc", num_speculative_tokens=4)
    config = json.loads((folder / "config.json").read_text())
    keys = set(load_file(str(folder / "model.safetensors")))
    if layout == "specforge":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["draft_vocab_size"] == DRAFT_VOCAB and config["num_hidden_layers"] == 1
        assert config["target_hidden_size"] == cfg.hidden_size and config["vocab_size"] == cfg.vocab_size
        assert keys == SPECFORGE_KEYS
    else:
        assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1
        assert config["norm_before_residual"] is False
        assert config["speculators_config"]["verifier"] == {"name_or_path": "org/tiny",
                                                            "architectures": ["Qwen2ForCausalLM"]}
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert keys == {k.replace("midlayer.", "layers.0.") for k in SPECFORGE_KEYS}
    loaded, ours = load_eagle3(folder)
    assert ours["target_fingerprint"] == "abc" and loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(loaded.target_ids, head.target_ids)


def test_foreign_layer_conventions(target_dir, tmp_path):
    """A SpecForge config names layer outputs, a speculators one layer inputs (vLLM's reading)."""
    head = random_head(ModelConfig.from_dir(target_dir))
    folder = save_eagle3(head, tmp_path / "sf")
    config = json.loads((folder / "config.json").read_text())
    del config["specdecode"]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    (folder / "config.json").write_text(json.dumps(config))
    assert load_eagle3(folder)[0].config.hidden_layers == (2, 4, 5)
    folder = save_eagle3(head, tmp_path / "spec", "speculators")
    config = json.loads((folder / "config.json").read_text())
    del config["specdecode"]
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_eagle3(folder)[0].config.hidden_layers == (1, 3, 4)
    del config["norm_before_residual"]  # vLLM's default for a missing flag is True: not ours
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="norm_before_residual"):
        load_eagle3(folder)


def test_drafting_computes_what_training_computes(target_dir):
    """The drafter's incremental head rows (its cache, positions and masks) give the logits the
    unrolled training pass gives for the same tokens: what is trained is what drafts."""
    target = Decoder.from_dir(target_dir)
    head = random_head(target.config, seed=2).eval()
    tokens = torch.randint(0, target.config.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    capture = HiddenCapture(head.config.hidden_layers)
    target.forward(tokens, target.new_cache(64), capture=capture)
    states = capture.take()
    t, steps = 30, 3
    with torch.no_grad():
        unrolled = head.unrolled_logits(states[:t], target.embed_tokens(tokens[1 : t + steps]), steps)
        drafter = EagleDrafter(head, target, capacity=64, quantize=False)
        seq = SequenceState(tokens[: t + 1].tolist(), 5, SamplingParams())
        drafter.begin(seq)
        drafter.observe_hidden(states[:20])
        drafter.observe_hidden(states[20:t])  # in two parts, as a prefill and a verify step give them
        feature = drafter._catch_up(seq)
        torch.testing.assert_close(head.logits(feature), unrolled[0][t - 1 :], atol=1e-5, rtol=1e-4)
        for j in range(1, steps):  # teacher-forced later steps, as in training
            slot = t + j - 1
            feature = drafter._rows(feature, tokens[t + j : t + j + 1], slot, torch.tensor([slot]), None)
            torch.testing.assert_close(head.logits(feature), unrolled[j][t - 1 :], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tree_width", [0, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identity(llms, plain, k, tree_width):
    llm, drafted = llms[tree_width], 0
    for seed in range(6):
        spec = llm.generate(_prompt(seed), _greedy(), method="eagle", num_speculative_tokens=k)[0]
        assert spec.token_ids == plain(tree_width, seed).token_ids, (k, tree_width, seed)
        drafted += spec.stats.draft_tokens
    assert drafted > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A sharp tiny target and a head trained on its greedy output: its drafts are often, not
    always, accepted, so sampling runs both the accept and the reject paths."""
    from specdecode.train import eagle3, loop
    from specdecode.train.capture import draft_vocabulary

    root = tmp_path_factory.mktemp("trained")
    target = sharp_target(root / "target")
    llm = LLM(model=str(target), max_seq_len=300, progress=False)
    cfg = Eagle3Config.for_target(llm.target.config, draft_vocab_size=DRAFT_VOCAB, intermediate_size=96)
    examples = greedy_examples(llm, cfg.hidden_layers, 60)
    head = eagle3.new_head(llm.target, cfg, draft_vocabulary(examples, DRAFT_VOCAB, cfg.vocab_size))
    embed = llm.target.embed_tokens
    loop.run(head, examples, lambda ex: eagle3.loss(head, ex, embed, 3), dict, root / "run",
             loop.LoopConfig(lr=1e-3, max_steps=150, eval_every=1000), progress=False)
    return target, save_eagle3(head, root / "head", target_fingerprint=config_fingerprint(target))


@pytest.mark.parametrize("tree_width", [0, 2], ids=["chain", "tree"])
def test_sampled_tokens_follow_the_exact_target_distribution(trained, tree_width):
    target, head = trained
    llm = LLM(model=str(target), eagle_head=str(head), max_seq_len=300, progress=False, head_tree_width=tree_width)
    ids = _prompt_with_likely_continuations(llm, SamplingParams(max_tokens=3, temperature=1.0, top_k=3))
    assert_sampled_joint_is_exact(llm, ids, lambda: llm.new_drafter("eagle"), k=2 if not tree_width else 4)


def test_method_without_a_head_is_a_clear_error(target_dir):
    llm = LLM(model=str(target_dir), max_seq_len=64, progress=False)
    with pytest.raises(InvalidConfigError, match="eagle_head"):
        llm.generate("hi", _greedy(2), method="eagle")


def test_head_for_another_target_is_refused(target_dir, tmp_path):
    other = make_tiny_llm(tmp_path / "other", "qwen2", seed=3, tie_word_embeddings=False, num_hidden_layers=8,
                          hidden_size=32)
    folder = save_eagle3(random_head(ModelConfig.from_dir(other)), tmp_path / "head", target_name="other",
                         target_fingerprint=config_fingerprint(other))
    with pytest.raises(HeadMismatchError, match="trained for other.*width 32"):
        LLM(model=str(target_dir), eagle_head=str(folder), max_seq_len=64, progress=False)


def test_missing_or_damaged_head_is_a_named_error(target_dir, head_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no head folder"):
        LLM(model=str(target_dir), eagle_head=str(tmp_path / "nowhere"), max_seq_len=64, progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((head_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="damaged or incomplete"):
        load_eagle3(broken)
    weights = load_file(str(head_dir / "model.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_eagle3(broken)


@pytest.mark.parametrize("tree_width", [0, 3], ids=["chain", "tree"])
def test_batched_requests_get_their_solo_output(llms, tree_width):
    """In the server's scheduler each request's drafter receives its own rows of the shared
    verify forward's hidden states."""
    from specdecode.server.scheduler import Scheduler
    from tests.conftest import spec_k
    from tests.test_scheduler import _prompts, _run_concurrently

    llm = llms[tree_width]
    prompts = _prompts(llm, 5)
    params = [SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True) for i in range(5)]
    solo = [llm.engine.generate(p, q, llm.drafter("eagle"), spec_k(4)) for p, q in zip(prompts, params)]
    results = _run_concurrently(Scheduler(llm, method="eagle", k=4, max_concurrency=3, max_queue=8), prompts, params)
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]
    assert sum(out.stats.draft_tokens for _, out in results) > 0


def test_draft_quantize_none_keeps_the_head_in_floats(target_dir, head_dir):
    from specdecode.drafters.registry import build_drafter
    from specdecode.models.draft_heads import DraftLinear

    for mode, packed in (("int4", True), ("none", False)):
        llm = LLM(model=str(target_dir), eagle_head=str(head_dir), max_seq_len=256, progress=False,
                  draft_quantize=mode)
        drafter = build_drafter("eagle", llm.resources, 256)
        assert any(isinstance(m, DraftLinear) for m in drafter.head.modules()) is packed, mode


@pytest.mark.parametrize("tree_width", [0, 3], ids=["chain", "tree"])
def test_greedy_identity_under_a_grammar(llms, tree_width):
    """Structured output: drafts the regex rejects are cut (tree nodes too), every row is masked."""
    llm = llms[tree_width]
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=Constraint("regex", r"[a-z =]{1,30}\."))
    for seed in range(3):
        plain = llm.generate(_prompt(seed), params, method="none")[0]
        spec = llm.generate(_prompt(seed), params, method="eagle", num_speculative_tokens=4)[0]
        assert spec.token_ids == plain.token_ids, (tree_width, seed)
