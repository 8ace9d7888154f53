"""The data a chain trained on, pinned: a chain keys on row indices, so the rows behind the indices it trained must
not move between sessions.

Every checkpoint (and its Hub index entry) records:
- the source (data/sources.py): a Hub dataset's revision (its commit), its config, split and files when named, and
  for parquet the split's index (each file's LFS sha256 from the Hub's listing, size and row groups: later sessions
  read it from here); a local file's size and sha256 (a folder's: of its files; parquet: of their footers); or the
  built-in's name;
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
from typing import Any

from fsdp_opt.data.resolve import DataSource

PIN_KEY = "data_pin"  # of a checkpoint's payload and of its Hub index entry


def pinned_revision(pin: dict[str, Any] | None, src: DataSource) -> str | None:
    """The commit the chain recorded for this Hub dataset's split; None for another dataset, split or source."""
    source = (pin or {}).get("source") or {}
    if source.get("kind") != "hub" or source.get("id") != src.dataset:
        return None
    if any(source.get(k) != src.names().get(k) for k in ("config", "split", "files")):
        return None
    return source.get("revision")


def rows_digest(rows: list[dict[str, Any]], indices: list[int]) -> str:
    digest = hashlib.sha256()
    for index, row in zip(indices, rows):
        digest.update(f"{index}:".encode() + json.dumps(row, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()[:32]


def tokens_digest(sequences: Any) -> str:
    """The token fingerprint of what a step reads (blocks, preference pairs, prompts): each makes its own digest."""
    return sequences.digest()


def described(source: dict[str, Any] | None) -> str:
    if not source:
        return "unknown"
    if source["kind"] in ("file", "folder"):
        if "footers" in source:  # parquet, known by its footers
            return f"{source['bytes']:,} bytes, parquet footers {source['footers'][:12]}"
        return f"{source['bytes']:,} bytes, sha256 {source['sha256'][:12]}"
    if source["kind"] == "hub":
        return f"revision {source['revision'] or 'unknown'}"
    if source["kind"] == "mixture":
        return (
            "a mixture, weights "
            + ":".join(map(str, source["weights"]))
            + ", of "
            + "; ".join(
                f"{s['dataset']} ({described(s['identity'])})" if "identity" in s else s["dataset"]
                for s in source["sources"]
            )
        )
    return source["name"]


def mixture_changed(recorded: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """How a mixture's definition changed since the chain recorded it (its weights, or its list of sources: their
    order, names, splits), which moves rows between sources; None when only the sources' own data changed (rows
    appended to one of them, say) or when neither is a mixture."""
    recorded, now = recorded or {}, now or {}
    if "mixture" not in (recorded.get("kind"), now.get("kind")):
        return None
    if recorded.get("kind") != now.get("kind"):
        return f"it was {described(recorded)}, now {described(now)}"

    def listed(source: dict[str, Any]) -> list[tuple]:
        return [
            tuple((k, str(v)) for k, v in sorted(s.items()) if k not in ("identity", "weight"))
            for s in source["sources"]
        ]

    if listed(recorded) != listed(now):
        return (
            "its list of sources changed ("
            + ", ".join(s["dataset"] for s in recorded["sources"])
            + " -> "
            + ", ".join(s["dataset"] for s in now["sources"])
            + ")"
        )
    if recorded["weights"] != now["weights"]:
        return (
            f"its weights changed ({':'.join(map(str, recorded['weights']))} -> {':'.join(map(str, now['weights']))})"
        )
    return None


def packed_as(max_length: int, packing: str) -> dict[str, Any]:
    """The settings a range's token fingerprint depends on."""
    return {"max_length": max_length, "packing": packing}


def with_range(
    pin: dict[str, Any] | None,
    source: dict[str, Any],
    start: int,
    end: int,
    rows: str,
    tokens: str,
    blocks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The pin after training rows [start, end): the source as read now, and this range's fingerprints. `blocks`:
    the settings the tokens were packed under (max_length, packing), which their fingerprint depends on."""
    ranges = [r for r in (pin or {}).get("ranges", []) if (r["start"], r["end"]) != (start, end)]
    ranges.append({"start": start, "end": end, "rows": rows, "tokens": tokens, **(blocks or {})})
    return {"source": source, "ranges": sorted(ranges, key=lambda r: (r["start"], r["end"]))}
