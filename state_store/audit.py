"""Signed audit exports of the pan-private state.

An export is a snapshot an auditor may inspect: the serialized state (already epsilon-DP), the
window, the source offsets and an export id, signed with HMAC-SHA256 so the auditor can check it
came from this aggregator and was not altered. The signing key comes from ``PANAGG_AUDIT_KEY``
(hex, at least 32 hex digits) or from a key file; it authenticates, it does not protect privacy.

The service re-randomizes the live state with a fresh DLap layer just before the snapshot is
taken and again just after (docs/privacy.md: that is what keeps an intrusion, any number of
exports and the release jointly epsilon-DP), and ledgers every export.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from pathlib import Path

import msgpack

from .atomic import atomic_write

__all__ = [
    "AuditKeyError",
    "ExportError",
    "check_configured_key",
    "load_key",
    "write_export",
    "read_export",
]

_FORMAT = "panagg.audit-export"


class AuditKeyError(ValueError):
    """No usable signing key."""


class ExportError(ValueError):
    """An export file that is unreadable or whose signature does not verify."""


def load_key(key_file: str | None = None) -> bytes:
    """The HMAC key: ``PANAGG_AUDIT_KEY`` (hex) wins, else the key file's hex contents."""
    text = os.environ.get("PANAGG_AUDIT_KEY")
    where = "PANAGG_AUDIT_KEY"
    if not text and key_file:
        try:
            text = Path(key_file).read_text().strip()
        except OSError as exc:
            raise AuditKeyError(f"cannot read audit key file {key_file}: {exc.strerror}") from None
        where = key_file
    if not text:
        raise AuditKeyError(
            "no audit signing key: set PANAGG_AUDIT_KEY to 64 hex digits "
            "(e.g. from `openssl rand -hex 32`) or audit.key_file in the config"
        )
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise AuditKeyError(
            f"audit key in {where} is not hex: use 64 hex digits (e.g. from `openssl rand -hex 32`)"
        ) from None
    if len(key) < 16:
        raise AuditKeyError(
            f"audit key in {where} is too short ({2 * len(key)} hex digits): "
            "use at least 32 hex digits, e.g. 64 from `openssl rand -hex 32`"
        )
    return key


def check_configured_key(key_file: str | None = None) -> None:
    """At a service's start: a configured key must be usable (:func:`load_key`), so that a
    mistyped key stops the start instead of the first export, perhaps months later. No key at
    all (``PANAGG_AUDIT_KEY`` unset, no ``audit.key_file``) is allowed: exports are
    then refused. ``PANAGG_AUDIT_KEY`` set to an empty (or blank) string is refused too: it
    is what a missing secret or an unset shell variable expands to, so it says "a key was
    meant here". Raises :class:`AuditKeyError` with one line naming the fix; never the key."""
    raw = os.environ.get("PANAGG_AUDIT_KEY")
    if raw is not None and not raw.strip():
        raise AuditKeyError(
            "PANAGG_AUDIT_KEY is set but empty: set it to 64 hex digits (e.g. "
            "from `openssl rand -hex 32`), or unset it to run with audit "
            "exports refused"
        )
    from_env = bool(raw)
    if not from_env and not key_file:
        return
    try:
        load_key(key_file)
    except AuditKeyError as exc:
        instead = "unset PANAGG_AUDIT_KEY" if from_env else "unset audit.key_file"
        raise AuditKeyError(f"{exc}; or {instead} to run with audit exports refused") from None


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"panagg-audit-key-id" + key).hexdigest()[:16]


def signed_export(
    *, state: bytes, window: dict, offsets: dict, export_id: str, key: bytes
) -> bytes:
    """The signed export document (what :func:`write_export` writes)."""
    body = msgpack.packb(
        {
            "format": _FORMAT,
            "version": 1,
            "export_id": export_id,
            "created_unix": time.time(),
            "window": window,
            "offsets": offsets,
            "state": state,
        },
        use_bin_type=True,
    )
    sig = hmac.new(key, body, hashlib.sha256).digest()
    return msgpack.packb(
        {"body": body, "hmac_sha256": sig, "key_id": key_id(key)}, use_bin_type=True
    )


def write_export(
    path: str | os.PathLike,
    *,
    state: bytes,
    window: dict,
    offsets: dict,
    export_id: str,
    key: bytes,
) -> Path:
    return save_export(
        path,
        signed_export(state=state, window=window, offsets=offsets, export_id=export_id, key=key),
    )


def save_export(path: str | os.PathLike, doc: bytes) -> Path:
    """Write a signed export document (:func:`signed_export`) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, [doc])
    return path


def read_export(path: str | os.PathLike, key: bytes | None = None) -> dict:
    """Parse an export; with ``key``, verify its signature (ExportError if it fails)."""
    try:
        doc = msgpack.unpackb(Path(path).read_bytes(), raw=False)
        body = doc["body"]
        sig = doc["hmac_sha256"]
        parsed = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc.strerror}") from None
    except Exception:
        raise ExportError(f"{path} is not a panagg audit export") from None
    if parsed.get("format") != _FORMAT:
        raise ExportError(f"{path} is not a panagg audit export")
    parsed["key_id"] = doc.get("key_id")
    parsed["verified"] = False
    if key is not None:
        if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), sig):
            raise ExportError(
                f"{path}: signature does not verify (altered, or signed with another key)"
            )
        parsed["verified"] = True
    return parsed
