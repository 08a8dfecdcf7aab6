"""What travels between shuffle-model clients, the shuffler and the analyzer (docs/shuffle.md).

Three hops, three formats:

1. **Plaintext message** (inside a sealed box): 9 bytes, the int64 bucket little-endian and one
   signed byte (+1 or -1): one row of a randomizer's ``encode`` output. Fixed size, so a
   ciphertext's length says nothing about its content.
2. **Client record** (client topic): Kafka key = 16 random bytes (the event id the shuffler
   deduplicates redelivered records by; random, so it links nothing), value = msgpack
   ``{"v": 1, "boxes": [sealed box, ...]}``: every message of one event, each sealed to the
   analyzer's public key (libsodium sealed box: X25519 + XSalsa20-Poly1305, 48 bytes overhead),
   so the shuffler, which sees event boundaries, cannot read any of them.
3. **Analyzer records** (analyzer topic, one partition): the shuffler's permuted window, cut in
   chunks ``{"v": 1, "window": k, "boxes": [...]}`` (chunk boundaries fall in the permuted list,
   so they carry nothing), then one marker ``{"v": 1, "window": k, "end": true, "events": e,
   "topped_up": t, "messages": m}``, optionally with ``"params": {"protocol", "epsilon",
   "delta", "n", "buckets", "gamma"}``, the randomizer parameters the shuffler topped up with
   (the analyzer refuses a window whose parameters differ from its own). No key, no headers,
   one timestamp for the whole window.

>>> keys = new_keypair()
>>> rows = np.array([[3, 1], [5, -1]], dtype=np.int64)
>>> boxes = seal_rows(rows, keys.public_key)
>>> len(boxes), len(boxes[0]) == SEALED_SIZE
(2, True)
>>> open_boxes(boxes, keys).tolist()
[[3, 1], [5, -1]]
"""

from __future__ import annotations

import os
import secrets
import struct

import msgpack
import numpy as np
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox

WIRE_VERSION = 1
PLAIN_SIZE = 9
SEALED_SIZE = PLAIN_SIZE + 48  # ephemeral X25519 public key (32) + Poly1305 tag (16)
EVENT_ID_SIZE = 16
_PLAIN = struct.Struct("<qb")


class WireError(ValueError):
    """A record or box that does not follow the format (the message says which and why)."""


def new_keypair() -> PrivateKey:
    """A fresh analyzer key pair (X25519) from the OS CSPRNG."""
    return PrivateKey.generate()


def save_private_key(key: PrivateKey, path: str) -> None:
    """Write the 32-byte private key, hex, to a new file readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(bytes(key).hex() + "\n")


def load_private_key(path: str) -> PrivateKey:
    try:
        text = open(path).read().strip()
        return PrivateKey(bytes.fromhex(text))
    except FileNotFoundError:
        raise WireError(f"analyzer private key file {path} does not exist; create one with "
                        "`panagg shuffle-keygen`") from None
    except (ValueError, TypeError):
        raise WireError(f"{path} does not hold a 32-byte hex X25519 private key") from None


def public_key_hex(key: PrivateKey) -> str:
    return bytes(key.public_key).hex()


def load_public_key(text_or_path: str) -> PublicKey:
    """A public key given as 64 hex digits or as a file holding them."""
    text = text_or_path.strip()
    if not (len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)):
        try:
            text = open(text_or_path).read().strip()
        except OSError:
            raise WireError(f"{text_or_path!r} is neither 64 hex digits nor a readable key file") from None
    try:
        return PublicKey(bytes.fromhex(text))
    except (ValueError, TypeError):
        raise WireError("the analyzer public key must be 32 bytes, 64 hex digits") from None


def seal_rows(rows: np.ndarray, public_key: PublicKey) -> list[bytes]:
    """Each ``(bucket, sign)`` row as a sealed box for ``public_key``."""
    box = SealedBox(public_key)
    return [box.encrypt(_PLAIN.pack(int(b), int(s))) for b, s in rows]


def open_boxes(boxes, private_key: PrivateKey) -> np.ndarray:
    """Decrypt sealed boxes to an (m, 2) int64 array; a box that fails raises WireError."""
    box = SealedBox(private_key)
    out = np.empty((len(boxes), 2), dtype=np.int64)
    for i, c in enumerate(boxes):
        try:
            plain = box.decrypt(bytes(c))
        except CryptoError:
            raise WireError("a message does not decrypt with the analyzer's key "
                            "(sealed to another key, or corrupted)") from None
        if len(plain) != PLAIN_SIZE:
            raise WireError(f"a decrypted message has {len(plain)} bytes, not {PLAIN_SIZE}")
        out[i] = _PLAIN.unpack(plain)
    return out


def new_event_id() -> bytes:
    return secrets.token_bytes(EVENT_ID_SIZE)


def client_record(boxes: list[bytes]) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "boxes": boxes}, use_bin_type=True)


def parse_client_record(value: bytes) -> list[bytes]:
    try:
        doc = msgpack.unpackb(value, raw=False)
    except Exception:
        raise WireError("client record is not msgpack") from None
    if not isinstance(doc, dict) or doc.get("v") != WIRE_VERSION or not isinstance(doc.get("boxes"), list):
        raise WireError(f"client record is not a v{WIRE_VERSION} {{'v', 'boxes'}} map")
    boxes = doc["boxes"]
    if not boxes or not all(isinstance(b, bytes) and len(b) == SEALED_SIZE for b in boxes):
        raise WireError(f"client record's boxes must be non-empty and {SEALED_SIZE} bytes each")
    return boxes


def chunk_record(window: int, boxes: list[bytes]) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "window": int(window), "boxes": boxes}, use_bin_type=True)


def end_record(window: int, events: int, topped_up: int, messages: int,
               params: dict | None = None) -> bytes:
    doc = {"v": WIRE_VERSION, "window": int(window), "end": True, "events": int(events),
           "topped_up": int(topped_up), "messages": int(messages)}
    if params is not None:  # the randomizer parameters (PARAM_KEYS), checked by the analyzer
        doc["params"] = {k: params[k] for k in PARAM_KEYS if k in params}
    return msgpack.packb(doc, use_bin_type=True)


#: what an end marker's optional ``params`` holds (str protocol, floats, ints)
PARAM_KEYS = ("protocol", "epsilon", "delta", "n", "buckets", "gamma")


def parse_analyzer_record(value: bytes) -> dict:
    """A chunk ({'window', 'boxes'}) or an end marker ({'window', 'end', ...})."""
    try:
        doc = msgpack.unpackb(value, raw=False)
    except Exception:
        raise WireError("analyzer record is not msgpack") from None
    if not isinstance(doc, dict) or doc.get("v") != WIRE_VERSION or not isinstance(doc.get("window"), int):
        raise WireError(f"analyzer record is not a v{WIRE_VERSION} chunk or end marker")
    if doc.get("end") is True:
        return doc
    if not isinstance(doc.get("boxes"), list):
        raise WireError("analyzer chunk has no boxes")
    return doc
