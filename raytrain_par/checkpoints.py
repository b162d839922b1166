"""Checkpoint integrity: every rank lists the files it wrote, with sizes and SHA-256 sums, in a
manifest beside them; a checkpoint is used only if every rank's manifest is there and every file
matches it. A checkpoint cut short by a crash, a full disk or a bad copy is found before loading,
never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, rank: int, world_size: int, step: int, known: dict | None = None) -> None:
    """List every file of `directory` (this rank's part of a checkpoint) in manifest-rank<r>.json; `known`:
    the size and SHA-256 of files hashed as they were written (not read again)."""
    known = known or {}
    files = {f.name: known.get(f.name) or {"bytes": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(directory.iterdir()) if f.is_file() and not f.name.startswith("manifest-")}
    manifest = {"format": FORMAT, "rank": rank, "world_size": world_size, "step": step, "files": files}
    (directory / f"manifest-rank{rank}.json").write_text(json.dumps(manifest, indent=1))


def problem(directory: str | Path, checksums: bool = True) -> str | None:
    """What is wrong with a (merged) checkpoint directory, or None if it is intact (without `checksums`:
    every file there at the size written, a check that reads no data)."""
    directory = Path(directory)
    manifests = sorted(directory.glob("manifest-rank*.json"))
    if not manifests:
        return "it has no manifest (not written by raytrain-par, or cut short before the end)"
    try:
        parsed = [json.loads(m.read_text()) for m in manifests]
    except (OSError, ValueError) as e:
        return f"a manifest is unreadable ({e})"
    world = parsed[0].get("world_size")
    ranks = sorted(m.get("rank") for m in parsed)
    if ranks != list(range(world or 0)):
        return f"it holds the manifests of ranks {ranks}, but was written by {world} ranks"
    steps = {m.get("step") for m in parsed}
    if len(steps) != 1:
        return f"its ranks wrote different steps {sorted(steps)}"
    for m in parsed:
        for name, meta in m["files"].items():
            f = directory / name
            if not f.is_file():
                return f"{name} (rank {m['rank']}) is missing"
            if f.stat().st_size != meta["bytes"]:
                return f"{name} (rank {m['rank']}) has {f.stat().st_size} bytes, {meta['bytes']} were written"
            if checksums and _sha256(f) != meta["sha256"]:
                return f"{name} (rank {m['rank']}) does not match its checksum"
    return None
