"""Self-speculation by layer skipping: the view, the drafter's exactness, and calibration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.self_spec.calibrate import (Sample, agreement, calibrate, draft_cost, encode_prompts, estimated_speedup,
                                  expected_tokens, greedy_continuation, search_skip)
from specdecode.cli import main
from specdecode.drafters.self_spec.drafter import SelfSpecDrafter
from specdecode.errors import InvalidConfigError
from specdecode.models.config import config_fingerprint
from specdecode.drafters.self_spec.layers import (SKIP_FILE_NAME, check_skip, default_skip, load_skip,
                                            save_skip, skip_file)
from specdecode.drafters.self_spec.skip import skip_layers
from tests.conftest import make_tiny_llm, spec_k
from tests.test_lossless import _prompt
from tests.test_sampling_lossless import assert_sampled_joint_is_exact

SEEDS = range(6)
LAYERS = 4
QUIET_LAYERS = (1, 2)  # the layers whose output deep_target scales down


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory) -> Path:
    """A 4-layer tiny target, so skip sets have some choice (the shared pair has 2 layers).

    In a random model every layer rewrites the residual stream and skipping any one leaves
    almost no agreement; trained models change it little in their middle layers. Scaling the
    outputs of layers 1 and 2 down mimics that: skipping them keeps most greedy tokens
    (alpha about 0.7-0.8), skipping layer 0 or 3 almost none.
    """
    from transformers import AutoModelForCausalLM

    path = make_tiny_llm(tmp_path_factory.mktemp("deep") / "target", "qwen2", seed=11,
                         tie_word_embeddings=False, num_hidden_layers=LAYERS)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for i in QUIET_LAYERS:
            model.model.layers[i].self_attn.o_proj.weight.mul_(0.08)
            model.model.layers[i].mlp.down_proj.weight.mul_(0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(deep_target) -> LLM:
    return LLM(model=str(deep_target), max_seq_len=512, progress=False)


@pytest.fixture(scope="module")
def samples(llm) -> list[Sample]:
    ids = encode_prompts(llm.tokenizer, ["hello there", "def f(x): return x + 1", "class A:"])
    return [greedy_continuation(llm.target, p, 24) for p in ids]


def _greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# --- the view -------------------------------------------------------------------------------------

def test_view_shares_every_weight_and_sizes_its_cache_for_kept_layers(llm):
    target = llm.target
    view = skip_layers(target, [2, 1])
    assert view.config.num_layers == 2 and target.config.num_layers == LAYERS
    assert len(target.layers) == LAYERS  # the target is untouched
    assert view.layers[0] is target.layers[0] and view.layers[1] is target.layers[3]
    for name in ("embed", "lm_head", "norm", "cos", "sin"):
        assert getattr(view, name).data_ptr() == getattr(target, name).data_ptr(), name
    for kept, original in zip(view.layers, (target.layers[0], target.layers[3])):
        assert kept.qkv.data_ptr() == original.qkv.data_ptr()
        assert kept.down.data_ptr() == original.down.data_ptr()
    cache = view.new_cache(64)
    assert cache.k.shape[0] == 2 and target.new_cache(64).k.shape[0] == LAYERS


def test_view_without_skips_computes_the_target_and_with_skips_differs(llm):
    tokens = torch.tensor(llm.tokenizer.encode("def f(x): return x"))
    target = llm.target
    full = target.forward(tokens, target.new_cache(64))
    same = skip_layers(target, [])
    assert torch.equal(same.forward(tokens, same.new_cache(64)), full)
    view = skip_layers(target, [1])
    assert not torch.allclose(view.forward(tokens, view.new_cache(64)), full)


@pytest.mark.parametrize("skip", [[4], [-1], [1, 1], [0, 1, 2, 3], ["1"], [True]])
def test_invalid_skip_sets_are_refused(llm, skip):
    with pytest.raises(InvalidConfigError):
        skip_layers(llm.target, skip)
    with pytest.raises(InvalidConfigError):
        SelfSpecDrafter(llm.target, skip, 64)


def test_default_skip_is_about_half_the_middle():
    assert default_skip(2) == [1]
    with pytest.raises(InvalidConfigError):
        default_skip(1)
    for n in range(3, 81):
        skip = default_skip(n)
        assert check_skip(skip, n) == skip and skip
        assert 0 not in skip and n - 1 not in skip
        assert len(skip) == min(n // 2, n - 2 * max(1, round(n / 8)))
    assert default_skip(4) == [1, 2]


def test_drafter_defaults_to_the_heuristic(llm):
    drafter = SelfSpecDrafter(llm.target, None, 64)
    assert drafter.skip == tuple(default_skip(LAYERS))
    assert drafter.name == "self" and drafter.model.config.num_layers == LAYERS - len(drafter.skip)


# --- exactness through the engine -----------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_identity(llm, k):
    plain = {s: llm.engine.generate(llm.tokenizer.encode(_prompt(s)), _greedy()).token_ids for s in SEEDS}
    drafted = accepted = 0
    for skip in ([1], [1, 2], [0, 3]):
        for confidence in (0.0, 0.5):
            drafter = SelfSpecDrafter(llm.target, skip, 512, confidence)
            for seed in SEEDS:
                out = llm.engine.generate(llm.tokenizer.encode(_prompt(seed)), _greedy(), drafter, spec_k(k, adaptive=False))
                assert out.token_ids == plain[seed], (skip, confidence, seed)
                assert out.method == "self"
                drafted += out.stats.draft_tokens
                accepted += out.stats.accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_empty_skip_accepts_every_draft(llm, k):
    ids = llm.tokenizer.encode(_prompt(1))
    drafter = SelfSpecDrafter(llm.target, [], 512)
    out = llm.engine.generate(ids, _greedy(33), drafter, spec_k(k, adaptive=False))
    plain = llm.engine.generate(ids, _greedy(33))
    assert out.token_ids == plain.token_ids
    assert out.stats.draft_tokens > 0 and out.stats.acceptance_rate == 1.0
    assert out.stats.target_steps < plain.stats.target_steps


def test_seeded_sampling_is_reproducible(llm):
    drafter = SelfSpecDrafter(llm.target, [1], 512)
    ids = llm.tokenizer.encode("hello")
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    runs = [llm.engine.generate(ids, params, drafter, spec_k(4)).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20


def test_sampled_tokens_follow_the_exact_target_distribution(llm):
    """The joint law of the first three tokens (the 2nd and 3rd pass through verification)."""
    ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_sampled_joint_is_exact(llm, ids, lambda: SelfSpecDrafter(llm.target, [1], 512))


# --- calibration ----------------------------------------------------------------------------------

def test_calibration_data_is_the_targets_greedy_output(llm, samples):
    for s in samples:
        plain = llm.engine.generate(s.ids[: s.prompt_len], _greedy(24))
        assert plain.token_ids == s.ids[s.prompt_len :]
    assert agreement(skip_layers(llm.target, []), samples) == 1.0
    assert agreement(skip_layers(llm.target, [1, 2]), samples) < 1.0


def test_speed_model():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert estimated_speedup(1.0, 4, 1.0) == pytest.approx(1.0)  # drafting with the whole target gains nothing
    assert estimated_speedup(0.8, 4, 0.5) == pytest.approx((1 - 0.8**5) / 0.2 / 3.0)


def test_draft_cost_counts_kept_layers_and_the_head(llm):
    cfg = llm.target.config
    assert draft_cost(cfg, LAYERS) == pytest.approx(1.0)
    costs = [draft_cost(cfg, kept) for kept in range(LAYERS + 1)]
    assert costs == sorted(costs) and costs[0] > 0  # the LM head is paid even with no layer


def test_search_picks_a_valid_improving_skip_set(llm, samples):
    history = search_skip(llm.target, samples, k=4, max_skip=0.75, progress=False)
    assert 1 <= len(history) <= 3
    speeds = [c.speedup for c in history]
    assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)
    for step, c in enumerate(history, 1):
        assert len(c.skip) == step and check_skip(c.skip, LAYERS) == c.skip
        assert c.alpha == agreement(skip_layers(llm.target, c.skip), samples)
        cost = draft_cost(llm.target.config, LAYERS - step)
        assert c.speedup == pytest.approx(estimated_speedup(c.alpha, 4, cost))


def test_lazy_search_retries_only_the_best_candidates(llm, samples, monkeypatch):
    import specdecode.drafters.self_spec.calibrate as calibration

    tried: list[list[int]] = []
    real = calibration.agreement

    def spy(view, samples):
        tried.append([i for i, layer in enumerate(llm.target.layers) if all(layer is not v for v in view.layers)])
        return real(view, samples)

    monkeypatch.setattr(calibration, "agreement", spy)
    exact = search_skip(llm.target, samples, k=4, max_skip=0.75, progress=False, candidates=0)
    exact_tries = len(tried)
    tried.clear()
    lazy = search_skip(llm.target, samples, k=4, max_skip=0.75, progress=False, candidates=1)
    rounds = min(3, len(exact) + 1)  # a round that does not improve still ran
    assert exact_tries == sum([4, 3, 2][:rounds])
    assert len(lazy) >= 2 and len(tried) == LAYERS + min(2, len(lazy))  # one try per later round
    assert lazy[0] == exact[0]
    # Round 2 retried the layer that scored best in round 1 among those still kept.
    first = lazy[0].skip[0]
    alphas = {j: real(skip_layers(llm.target, [j]), samples) for j in range(LAYERS) if j != first}
    runner_up = max(alphas, key=lambda j: (alphas[j], -j))
    assert tried[LAYERS] == sorted([first, runner_up])


@pytest.mark.parametrize("kwargs", [dict(k=0), dict(k=33), dict(max_skip=0.0), dict(max_skip=1.0),
                                    dict(max_skip=0.2), dict(candidates=-1)])
def test_search_refuses_bad_settings(llm, samples, kwargs):
    with pytest.raises(InvalidConfigError):
        search_skip(llm.target, samples, progress=False, **kwargs)


def test_calibration_round_trips_through_the_model_folder(llm, samples, deep_target, tmp_path):
    model_dir = Path(shutil.copytree(deep_target, tmp_path / "model"))
    choice, history = calibrate(llm.target, model_dir, samples, k=4, max_skip=0.5, progress=False)
    assert choice.skip == history[-1].skip == list(QUIET_LAYERS)  # the layers that matter least
    assert 0.5 < choice.alpha < 1.0 and 1 <= choice.best_k <= 32
    assert choice.num_layers == LAYERS and choice.fingerprint == config_fingerprint(model_dir)
    assert choice.tokens == sum(s.continuation_len for s in samples)
    path = save_skip(choice, skip_file(model_dir))
    assert path == model_dir / SKIP_FILE_NAME and not list(model_dir.glob(".*.tmp"))
    assert load_skip(model_dir, llm.target.config) == choice.skip
    stored = json.loads(path.read_text())
    assert stored["alpha"] == choice.alpha and stored["k"] == 4


def _write(path: Path, **fields) -> None:
    path.write_text(json.dumps(fields))


def test_missing_stale_or_broken_files_are_ignored(llm, deep_target, tmp_path):
    model_dir = Path(shutil.copytree(deep_target, tmp_path / "model"))
    cfg = llm.target.config
    assert load_skip(model_dir, cfg) is None  # no file, no warning
    good = dict(skip=[1], num_layers=LAYERS, fingerprint=config_fingerprint(model_dir))
    _write(model_dir / SKIP_FILE_NAME, **good)
    assert load_skip(model_dir, cfg) == [1]
    for broken in (dict(good, fingerprint="0" * 16), dict(good, num_layers=LAYERS + 1), dict(good, skip=[7]),
                   dict(good, skip=[0, 1, 2, 3]), dict(skip=[1])):
        _write(model_dir / SKIP_FILE_NAME, **broken)
        with pytest.warns(UserWarning, match="recalibrate"):
            assert load_skip(model_dir, cfg) is None
    (model_dir / SKIP_FILE_NAME).write_text("{not json")
    with pytest.warns(UserWarning, match="not a valid calibration"):
        assert load_skip(model_dir, cfg) is None


def test_file_from_another_model_is_stale(llm, deep_target, tmp_path):
    model_dir = Path(shutil.copytree(deep_target, tmp_path / "model"))
    _write(model_dir / SKIP_FILE_NAME, skip=[1], num_layers=LAYERS, fingerprint=config_fingerprint(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_theta"] = 5000.0  # another model with the same layer count
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="another model"):
        assert load_skip(model_dir, llm.target.config) is None


# --- command line ---------------------------------------------------------------------------------

def test_cli_calibrates_and_stores_next_to_the_model(llm, deep_target, tmp_path, capsys):
    model_dir = Path(shutil.copytree(deep_target, tmp_path / "model"))
    assert main(["calibrate", "--model", str(model_dir), "--max-tokens", "16", "--num-prompts", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    skip = load_skip(model_dir, llm.target.config)
    assert skip and f"skip layers {skip}" in out and "estimated speedup" in out
    assert json.loads((model_dir / SKIP_FILE_NAME).read_text())["tokens"] <= 32


def test_cli_reads_jsonl_prompts_and_writes_to_output(llm, deep_target, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n\n" + json.dumps({"prompt": "hi"}) + "\n")
    output = tmp_path / "out" / "choice.json"
    assert main(["calibrate", "--model", str(deep_target), "--prompts", str(prompts), "--max-tokens", "8",
                 "--k", "2", "--raw", "--no-progress", "--output", str(output)]) == 0
    stored = json.loads(output.read_text())
    assert stored["prompts"] == 2 and stored["k"] == 2 and stored["num_layers"] == LAYERS
    assert not (deep_target / SKIP_FILE_NAME).exists()
    assert load_skip(deep_target, llm.target.config, path=output) == stored["skip"]


@pytest.mark.parametrize("extra, message", [
    (["--max-skip", "1.5"], "fraction"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--k", "0"], "k must be"),
    (["--prompts", "/nonexistent/prompts.txt"], "cannot read"),
    (["--candidates", "-1"], "--candidates"),
])
def test_cli_bad_input_is_a_clear_error(deep_target, tmp_path, capsys, extra, message):
    code = main(["calibrate", "--model", str(deep_target), "--no-progress", "--max-tokens", "4",
                 "--output", str(tmp_path / "x.json"), *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode: error:") and message in err


def test_cli_bad_jsonl_names_the_line(deep_target, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    assert main(["calibrate", "--model", str(deep_target), "--prompts", str(prompts), "--no-progress"]) == 2
    assert "line 2" in capsys.readouterr().err
