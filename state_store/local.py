"""Atomic local-directory store for checkpoints.

A checkpoint is one file, written by :func:`state_store.atomic.atomic_write`: temp file in the
same directory -> write -> fsync -> rename over the final name -> fsync the directory. A crash
at any instant leaves either the old checkpoint or the new one, never a torn file; a checksum
(SHA-256 over the header and the state bytes) is verified on load anyway. Only the latest
checkpoint is kept once the next is durable.

Checkpoint contents: the window (number, random uid, kind, start), the next offset of every
source partition, per-reason totals of rejected records and of counted events up to those
offsets, releases computed but not yet published, and *optionally* a state snapshot. Most
checkpoints carry no counters at all: the open window's counters live only in memory and are
rebuilt after a restart by replaying the window from the source (docs/privacy.md, "Views of the
state"). A checkpoint with a snapshot is an announced view, written between two fresh noise
layers of the live state, so it never shares its noise with memory or with another checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from .atomic import PRIVATE_MODE, atomic_write  # noqa: F401  (re-exported)
from .failpoints import failpoint

__all__ = ["Checkpoint", "CheckpointError", "LocalStore", "atomic_write"]

_FORMAT = "panagg.checkpoint"
_VERSION = 2
_NAME = re.compile(r"^checkpoint-(\d{12})\.ckpt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted (corrupt, truncated, foreign format)."""


@dataclass
class Checkpoint:
    state: bytes | None  # a layered snapshot, or None: replay the window
    window: dict  # id, uid, kind, events, started_unix, ...
    offsets: dict[str, int]  # next offset per source partition
    pending: list[str] = field(default_factory=list)  # release JSON documents not yet published
    totals: dict = field(default_factory=dict)  # events and rejects by reason up to ``offsets``
    seq: int = 0
    ledger_head: dict | None = None  # the privacy ledger's head when it was written
    #: closed windows whose release was not yet ledgered: each {"window", "end_offsets",
    #: "totals"}; ``offsets`` and ``totals`` are then where the first of them starts
    unreleased: list = field(default_factory=list)


def _checkpoint_fault(stage: str) -> None:
    """The failpoints of a checkpoint write: ``checkpoint-mid-write``, ``-before-rename``,
    ``-after-rename``."""
    failpoint(f"checkpoint-{stage}")


def _digest(header: dict, state: bytes) -> bytes:
    h = hashlib.sha256(msgpack.packb(header, use_bin_type=True))
    h.update(state)
    return h.digest()


class LocalStore:
    """Checkpoints in a local directory (created if missing)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".checkpoint-*.tmp-*"):  # left by a crash mid-write
            stale.unlink(missing_ok=True)

    def _files(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def save(self, ckpt: Checkpoint) -> Path:
        files = self._files()
        ckpt.seq = (files[-1][0] + 1) if files else 1
        state = ckpt.state or b""
        header = {
            "format": _FORMAT,
            "version": _VERSION,
            "seq": ckpt.seq,
            "window": ckpt.window,
            "offsets": ckpt.offsets,
            "pending": ckpt.pending,
            "totals": ckpt.totals,
            "has_state": ckpt.state is not None,
        }
        if ckpt.ledger_head is not None:
            header["ledger_head"] = dict(ckpt.ledger_head)
        if ckpt.unreleased:
            header["unreleased"] = list(ckpt.unreleased)
        body = msgpack.packb(dict(header, checksum=_digest(header, state)), use_bin_type=True)
        path = self.dir / f"checkpoint-{ckpt.seq:012d}.ckpt"
        # frame: 8-byte header length, header, state bytes
        atomic_write(path, [len(body).to_bytes(8, "little") + body, state], hook=_checkpoint_fault)
        for _, old in files:  # only the latest is kept
            old.unlink(missing_ok=True)
        return path

    def load_latest(self) -> Checkpoint | None:
        files = self._files()
        if not files:
            return None
        seq, path = files[-1]
        data = path.read_bytes()
        try:
            hlen = int.from_bytes(data[:8], "little")
            header = msgpack.unpackb(data[8 : 8 + hlen], raw=False, strict_map_key=False)
            state = data[8 + hlen :]
            checksum = header.pop("checksum")
        except Exception:
            raise CheckpointError(
                f"{path} is not a readable checkpoint; restore it from a backup "
                "of the state directory, or move it away and start with "
                "--fresh-start (its open window is then not released)"
            ) from None
        if header.get("format") != _FORMAT or header.get("version") not in (1, _VERSION):
            raise CheckpointError(f"{path} has an unknown checkpoint format")
        if _digest(header, state) != checksum:
            raise CheckpointError(
                f"{path} failed its checksum (corrupt); restore it from a "
                "backup of the state directory, or move it away and start with "
                "--fresh-start (its open window is then not released)"
            )
        if header["version"] == 1:  # always carried counters; restored as a snapshot
            header.update(totals={}, has_state=True)
        return Checkpoint(
            state=state if header["has_state"] else None,
            window=header["window"],
            offsets=header["offsets"],
            pending=list(header["pending"]),
            totals=dict(header["totals"]),
            seq=seq,
            ledger_head=header.get("ledger_head"),
            unreleased=list(header.get("unreleased") or []),
        )
