"""Checksums of model files: written by the build, verified by each model before it loads them.

`python -m tools build-models` writes `MANIFEST.json` into every version folder it fills: the
SHA-256 of each file it put there. A model's `initialize` calls `verify_artifacts` with the
files it is about to load; a file that is missing, unlisted or changed since the build makes
the load fail with an error naming the model, the version and the file, so a corrupted or
tampered weight file never serves. Other models are untouched: Triton loads each on its own.

What this does not do: a writer who can change the model files and the manifest together is
not stopped by it (keep the repository read-only to the serving user, as the image does).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

MANIFEST = "MANIFEST.json"
ALGORITHM = "sha256"
_CHUNK_BYTES = 1 << 20


class ArtifactError(ValueError):
    """A model file does not match the build's manifest (or cannot be checked); the message names it."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def make_manifest(folder: Path, names: Iterable[str]) -> dict:
    """The manifest of `names` in `folder`, as written to MANIFEST.json."""
    return {"algorithm": ALGORITHM, "files": {name: file_sha256(folder / name) for name in sorted(names)}}


def write_manifest(folder: Path, names: Iterable[str]) -> Path:
    """Write `folder`/MANIFEST.json for `names` (atomically: a reader sees the old or the new one)."""
    path = folder / MANIFEST
    staging = path.with_name(MANIFEST + ".tmp")
    staging.write_text(json.dumps(make_manifest(folder, names), indent=2) + "\n")
    staging.replace(path)
    return path


def parse_manifest(raw: str, where: str) -> dict[str, str]:
    """file name -> expected sha256, from the text of a manifest; ArtifactError when malformed."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{where}: {MANIFEST} is not valid JSON ({err})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
        raise ArtifactError(f"{where}: {MANIFEST} must be {{\"algorithm\": \"{ALGORITHM}\", \"files\": "
                            "{name: hex digest}}")
    for name, digest in files.items():
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ArtifactError(f"{where}: {MANIFEST} has no valid sha256 for {name}")
        if "/" in name or name in ("", ".", ".."):
            raise ArtifactError(f"{where}: {MANIFEST} names {name!r}, which is not a file of this folder")
    return dict(files)


def find_mismatches(expected: Mapping[str, str], actual: Mapping[str, str | None],
                    required: Iterable[str]) -> list[str]:
    """What is wrong, one sentence per file, in file order (pure: `actual` maps each listed file
    to its digest, or None when it is missing)."""
    problems = [f"{name} is needed but {MANIFEST} does not list it"
                for name in sorted(set(required) - set(expected))]
    for name in sorted(expected):
        found = actual.get(name)
        if found is None:
            problems.append(f"{name} is listed in {MANIFEST} but missing")
        elif found != expected[name]:
            problems.append(f"{name} does not match its checksum in {MANIFEST} "
                            f"(sha256 {expected[name][:12]}... expected, {found[:12]}... found)")
    return problems


def verify_artifacts(folder: Path, model: str, required: Iterable[str]) -> None:
    """Check every file the manifest in `folder` lists, and that it lists each of `required`.

    Raises ArtifactError naming the model and every file that fails; returns quietly otherwise.
    """
    where = f"model {model!r} version {folder.name}"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ArtifactError(f"{where}: no {MANIFEST} beside the model files, so they cannot be verified; "
                            "build them with `python -m tools build-models`")
    expected = parse_manifest(manifest_path.read_text(), where)
    actual = {name: file_sha256(folder / name) if (folder / name).is_file() else None for name in expected}
    problems = find_mismatches(expected, actual, list(required))
    if problems:
        raise ArtifactError(f"{where}: refusing to load: {'; '.join(problems)}. The file changed after the "
                            "build: restore it, or rebuild with `python -m tools build-models --force`")
