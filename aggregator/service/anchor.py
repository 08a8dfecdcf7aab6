"""Anchors of the ledger's head outside the ledger file.

A hash chain shows an edited or re-ordered line, but not a ledger that is *older* than it should
be: a deleted file, a dropped last line, a copy from a backup, or a whole state directory
restored together with its checkpoint. Those are caught by comparing the ledger with its head
(``seq``, ``hash``) recorded elsewhere at every checkpoint and every publication:

``checkpoint``
    Each checkpoint carries the head at the time it was written: a ledger older than the
    checkpoint beside it is refused. Restored *together* with its checkpoint, it passes here.
``release directory``
    ``release.dir/.panagg-ledger-head-<h>`` (``h``: a hash of the ledger's id, the hash of its
    first entry, so two state directories publishing to one release directory keep separate
    anchors, and a state directory restored or moved to another path is still recognised) is
    replaced after each publication. A state directory restored from a backup is older than it.
    (Anchors written before the id keyed them, by a hash of the ledger's absolute path, are
    still read.) A deleted anchor file loses this check only: the budget registry still holds
    every charge the ledger made (state_store/registry.py), so the events of a replayed window
    are refused, not released again.
``Kafka``
    The consumer group's committed offsets carry the head in their metadata (``panagg-ledger:
    <seq>:<hash prefix>``; several aggregations: one ``name=seq:hash`` item each). A state
    directory restored from a backup, or deleted, is older than the group.

A file source without Kafka has the first two only: restoring the state directory *and* the
release directory from the same backup goes unnoticed there (the start line says so).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from state_store.atomic import atomic_write

__all__ = [
    "release_dir_anchor",
    "write_release_dir_anchor",
    "kafka_metadata",
    "parse_kafka_metadata",
]

_PREFIX = "panagg-ledger:"
_HASH_CHARS = 24  # 96 bits of the head's hash: room for many aggregations in 4 kB of metadata


def _anchor_path(
    release_dir: str | os.PathLike, ledger_path: str | os.PathLike, lineage: str | None = None
) -> Path:
    key = f"ledger-id:{lineage}" if lineage else str(Path(ledger_path).resolve())
    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(release_dir) / f".panagg-ledger-head-{tag}"


def _read(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
        return {"seq": int(doc["seq"]), "hash": str(doc["hash"]), "where": str(path)}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return {"seq": 0, "hash": "", "where": str(path), "unreadable": True}


def release_dir_anchor(release_dir, ledger_path, lineage: str | None = None) -> dict | None:
    """The head last recorded in ``release_dir`` for the ledger with id ``lineage`` (its first
    entry's hash), or by the older name for the ledger at ``ledger_path`` (None: none;
    ``unreadable``, which is said by the caller). Of both, the further one."""
    found = [
        a
        for a in (
            _read(_anchor_path(release_dir, ledger_path, lineage)) if lineage else None,
            _read(_anchor_path(release_dir, ledger_path)),
        )
        if a
    ]
    bad = [a for a in found if a.get("unreadable")]
    if bad:
        return bad[0]
    return max(found, key=lambda a: a["seq"]) if found else None


def write_release_dir_anchor(
    release_dir, ledger_path, head: dict, lineage: str | None = None
) -> None:
    """Record ``head`` in ``release_dir`` (atomically) under the ledger's id ``lineage`` and
    under the ledger's path: the id recognises a state directory restored or moved elsewhere,
    the path a state directory deleted and started again empty (a new ledger has a new id)."""
    Path(release_dir).mkdir(parents=True, exist_ok=True)
    doc = {
        "ledger": str(Path(ledger_path).resolve()),
        "seq": int(head["seq"]),
        "hash": str(head["hash"]),
        **({"ledger_id": lineage} if lineage else {}),
    }
    for key in (lineage, None) if lineage else (None,):
        # public like the releases beside it: a hash of a public record
        atomic_write(
            _anchor_path(release_dir, ledger_path, key),
            json.dumps(doc, sort_keys=True) + "\n",
            mode=0o644,
        )


def kafka_metadata(heads: dict[str, dict]) -> str:
    """Offset-commit metadata carrying ``heads`` (aggregation name -> head; ``""`` for the
    single aggregation)."""
    items = [
        f"{name + '=' if name else ''}{h['seq']}:{h['hash'][:_HASH_CHARS]}"
        for name, h in sorted(heads.items())
    ]
    return _PREFIX + ",".join(items)


def parse_kafka_metadata(metadata: str | None) -> dict[str, dict]:
    """The heads in one committed offset's metadata ({} when it carries none)."""
    if not metadata or not metadata.startswith(_PREFIX):
        return {}
    out = {}
    for item in metadata[len(_PREFIX) :].split(","):
        name, _, head = item.rpartition("=")
        seq, _, digest = head.partition(":")
        try:
            out[name] = {"seq": int(seq), "hash": digest}
        except ValueError:
            continue
    return out
