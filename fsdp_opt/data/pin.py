"""The data a chain trained on, pinned: a chain keys on row indices, so the rows behind the indices it trained must
not move between sessions.

Every checkpoint (and its Hub index entry) records:
- the source: a Hub dataset's revision (its commit), a local file's size and sha256 (a folder's: of its files), or
  the built-in's name;
- for each range trained so far, a fingerprint of its rows (the columns the format reads) and of their token ids
  (ids and the mask of tokens that carry loss, as packed).

A later session loads a Hub dataset at the recorded revision (unless --dataset_revision says otherwise). When the
source is not what was recorded, it re-reads every trained range and refuses, in one line, if one of them changed:
rows added after the trained ranges are fine, a chain over a growing dataset is legitimate. The token fingerprint of
the range the checkpoint trained is checked every time: a changed tokenizer is caught the same way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fsdp_opt.data.blocks import Blocks
from fsdp_opt.data.sources import BUILTIN_DATASETS

PIN_KEY = "data_pin"  # of a checkpoint's payload and of its Hub index entry


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def source_identity(spec: str, revision: str | None = None) -> dict[str, Any]:
    """What the rows come from, as precisely as can be said of it."""
    if spec in BUILTIN_DATASETS:
        return {"kind": "builtin", "name": spec}
    path = Path(spec).expanduser()
    if path.is_file():
        return {"kind": "file", "path": spec, "bytes": path.stat().st_size, "sha256": _file_sha256(path)}
    if path.is_dir():
        digest, size = hashlib.sha256(), 0
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{f.relative_to(path).as_posix()}:{_file_sha256(f)}\n".encode())
            size += f.stat().st_size
        return {"kind": "folder", "path": spec, "bytes": size, "sha256": digest.hexdigest()}
    return {"kind": "hub", "id": spec, "revision": hub_revision(spec, revision)}


def hub_revision(dataset_id: str, revision: str | None) -> str | None:
    """The commit a Hub dataset's revision (a branch, tag or commit; None: main) points to now; None when the Hub
    cannot say."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(dataset_id, revision=revision).sha
    except Exception:  # noqa: BLE001 - offline: the rows still load from the cache, unpinned
        return None


def pinned_revision(pin: dict[str, Any] | None, dataset: str) -> str | None:
    """The commit the chain recorded for this Hub dataset; None for another dataset or source."""
    source = (pin or {}).get("source") or {}
    return source.get("revision") if source.get("kind") == "hub" and source.get("id") == dataset else None


def rows_digest(rows: list[dict[str, Any]], indices: list[int]) -> str:
    digest = hashlib.sha256()
    for index, row in zip(indices, rows):
        digest.update(f"{index}:".encode() + json.dumps(row, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()[:32]


def tokens_digest(blocks: Blocks) -> str:
    digest = hashlib.sha256()
    digest.update(blocks.input_ids.numpy().tobytes())
    digest.update(blocks.lengths.numpy().tobytes())
    if blocks.targets is not None:
        digest.update(blocks.targets.numpy().tobytes())
    return digest.hexdigest()[:32]


def described(source: dict[str, Any] | None) -> str:
    if not source:
        return "unknown"
    if source["kind"] in ("file", "folder"):
        return f"{source['bytes']:,} bytes, sha256 {source['sha256'][:12]}"
    if source["kind"] == "hub":
        return f"revision {source['revision'] or 'unknown'}"
    return source["name"]


def packed_as(max_length: int, packing: str) -> dict[str, Any]:
    """The settings a range's token fingerprint depends on."""
    return {"max_length": max_length, "packing": packing}


def with_range(pin: dict[str, Any] | None, source: dict[str, Any], start: int, end: int, rows: str, tokens: str,
               blocks: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The pin after training rows [start, end): the source as read now, and this range's fingerprints. `blocks`:
    the settings the tokens were packed under (max_length, packing), which their fingerprint depends on."""
    ranges = [r for r in (pin or {}).get("ranges", []) if (r["start"], r["end"]) != (start, end)]
    ranges.append({"start": start, "end": end, "rows": rows, "tokens": tokens, **(blocks or {})})
    return {"source": source, "ranges": sorted(ranges, key=lambda r: (r["start"], r["end"]))}
