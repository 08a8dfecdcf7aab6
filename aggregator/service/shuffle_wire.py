"""What travels between shuffle-model clients, the shuffler and the analyzer (docs/shuffle.md).

Three hops, three formats (wire version 2):
1. **Plaintext message** (inside a sealed box): 26 bytes, fixed size (a ciphertext's length says
   nothing about its content):
   ========  =====  =====================================================================
   bytes     type   what
   ========  =====  =====================================================================
   0-7       <i8    the bucket
   8         i1     the sign (+1, or -1 for GKMP)
   9-16      8 B    the **fingerprint** of the randomizer's parameters: the first 8 bytes of
                    SHA-256(``FINGERPRINT_DOMAIN`` + the 48-byte parameter descriptor)
   17        u1     a part index i in [0, 6), drawn from the OS CSPRNG for each message
   18-25     8 B    bytes 8i..8i+8 of the descriptor
   ========  =====  =====================================================================

   The descriptor (:class:`ParamTag`) is ``<B7xQQddd``: protocol (1 gkmp, 2 balcer-cheu), n,
   buckets, epsilon, delta, gamma (0 for balcer-cheu). Every message of a client carries its
   randomizer's fingerprint inside the sealed box, so only the analyzer reads it and it refuses
   a window holding any message whose fingerprint is not its own; the parts (a random one per
   message, so the part says nothing about the row) let it rebuild and name the parameters the
   clients used (a window holds thousands of messages; six parts suffice, and the fingerprint
   checks the rebuilt descriptor).
2. **Client record** (client topic): Kafka key = 16 random bytes (the event id the shuffler
   deduplicates redelivered records by; random, so it links nothing), value = msgpack
   ``{"v": 2, "boxes": [sealed box, ...]}``: every message of one event, each sealed to the
   analyzer's public key (libsodium sealed box: X25519 + XSalsa20-Poly1305, 48 bytes overhead),
   so the shuffler, which sees event boundaries, cannot read any of them.
3. **Analyzer records** (analyzer topic, one partition): the shuffler's permuted window, cut in
   chunks ``{"v": 2, "window": k, "boxes": [...]}`` (chunk boundaries fall in the permuted list,
   so they carry nothing), then one marker ``{"v": 2, "window": k, "end": true, "events": e,
   "topped_up": t, "messages": m}``, optionally with ``"params": {"protocol", "epsilon",
   "delta", "n", "buckets", "gamma"}``, the parameters the shuffler topped up with (its top-up
   messages carry their fingerprint like any client's; the marker's copy is informational). No
   key, no headers, one timestamp for the whole window.

>>> keys = new_keypair()
>>> rows = np.array([[3, 1], [5, -1]], dtype=np.int64)
>>> tag = ParamTag({"protocol": "gkmp", "epsilon": 1.0, "delta": 1e-6, "n": 100, "buckets": 8,
...                 "gamma": 0.1})
>>> boxes = seal_rows(rows, keys.public_key, tag)
>>> len(boxes), len(boxes[0]) == SEALED_SIZE
(2, True)
>>> open_boxes(boxes, keys).tolist()
[[3, 1], [5, -1]]
>>> opened = open_messages(boxes, keys)
>>> bool((opened.fingerprints == tag.fingerprint_u64).all())
True
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import struct
import subprocess
import sys
from dataclasses import dataclass

import msgpack
import numpy as np
from nacl.bindings import crypto_box_seal_open
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox

from state_store.atomic import atomic_write

WIRE_VERSION = 2
PLAIN_SIZE = 26
SEALED_SIZE = PLAIN_SIZE + 48  # ephemeral X25519 public key (32) + Poly1305 tag (16)
EVENT_ID_SIZE = 16
_PLAIN = struct.Struct("<qb8sB8s")
#: the plaintext as a numpy record (no padding: 26 bytes)
PLAIN_DTYPE = np.dtype(
    [("bucket", "<i8"), ("sign", "i1"), ("fingerprint", "<u8"), ("part", "u1"), ("chunk", "<u8")]
)
assert PLAIN_DTYPE.itemsize == PLAIN_SIZE == _PLAIN.size
_DESC = struct.Struct("<B7xQQddd")
DESC_PARTS = _DESC.size // 8  # 6 parts of 8 bytes
FINGERPRINT_DOMAIN = b"panagg shuffle randomizer parameters v1\0"
PROTOCOL_CODES = {"gkmp": 1, "balcer-cheu": 2}


class WireError(ValueError):
    """A record or box that does not follow the format (the message says which and why)."""


def new_keypair() -> PrivateKey:
    """A fresh analyzer key pair (X25519) from the OS CSPRNG."""
    return PrivateKey.generate()


def save_private_key(key: PrivateKey, path: str) -> None:
    """Write the 32-byte private key, hex, to a new file readable by its owner only (durably:
    the public key is handed out next); FileExistsError if ``path`` exists."""
    if not atomic_write(path, bytes(key).hex() + "\n", mode=0o600, exclusive=True):
        raise FileExistsError(errno.EEXIST, "a key file is never overwritten", str(path))


def load_private_key(path: str) -> PrivateKey:
    try:
        text = open(path).read().strip()
        return PrivateKey(bytes.fromhex(text))
    except FileNotFoundError:
        raise WireError(
            f"analyzer private key file {path} does not exist; create one with "
            "`panagg shuffle-keygen`"
        ) from None
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
            raise WireError(
                f"{text_or_path!r} is neither 64 hex digits nor a readable key file"
            ) from None
    try:
        return PublicKey(bytes.fromhex(text))
    except (ValueError, TypeError):
        raise WireError("the analyzer public key must be 32 bytes, 64 hex digits") from None


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


class ParamTag:
    """The randomizer parameters every message carries: descriptor, parts, fingerprint.

    ``params``: a randomizer's ``.params`` (or the same keys: protocol, epsilon, delta, n,
    buckets, gamma; gamma is ignored for balcer-cheu).
    """

    KEYS = ("protocol", "epsilon", "delta", "n", "buckets", "gamma")

    def __init__(self, params: dict):
        proto = str(params["protocol"])
        if proto not in PROTOCOL_CODES:
            raise ValueError(f"unknown shuffle protocol {proto!r}")
        gamma = float(params.get("gamma") or 0.0) if proto == "gkmp" else None
        self.params = {
            "protocol": proto,
            "epsilon": float(params["epsilon"]),
            "delta": float(params["delta"]),
            "n": int(params["n"]),
            "buckets": int(params["buckets"]),
            "gamma": gamma,
        }
        p = self.params
        self.descriptor = _DESC.pack(
            PROTOCOL_CODES[proto], p["n"], p["buckets"], p["epsilon"], p["delta"], gamma or 0.0
        )
        self.fingerprint = hashlib.sha256(FINGERPRINT_DOMAIN + self.descriptor).digest()[:8]
        self.fingerprint_u64 = int.from_bytes(self.fingerprint, "little")
        self.parts = [self.descriptor[8 * i : 8 * i + 8] for i in range(DESC_PARTS)]

    @classmethod
    def of(cls, randomizer) -> "ParamTag":
        return cls(randomizer.params)

    @classmethod
    def from_parts(cls, fingerprint_u64: int, parts: dict) -> "ParamTag | None":
        """The tag rebuilt from the descriptor parts seen (``{index: 8 bytes}``), if all six
        are there and they hash to the fingerprint; else None."""
        if any(i not in parts for i in range(DESC_PARTS)):
            return None
        desc = b"".join(parts[i] for i in range(DESC_PARTS))
        try:
            code, n, buckets, eps, delta, gamma = _DESC.unpack(desc)
            proto = {v: k for k, v in PROTOCOL_CODES.items()}[code]
            tag = cls(
                {
                    "protocol": proto,
                    "epsilon": eps,
                    "delta": delta,
                    "n": n,
                    "buckets": buckets,
                    "gamma": gamma,
                }
            )
        except (KeyError, ValueError, struct.error):
            return None
        return (
            tag if tag.fingerprint_u64 == int(fingerprint_u64) and tag.descriptor == desc else None
        )

    def differences(self, other: "ParamTag") -> list[tuple[str, str, str]]:
        """``[(key, this side, other side)]`` for every parameter that differs."""
        return [
            (k, _fmt(self.params[k]), _fmt(other.params[k]))
            for k in self.KEYS
            if self.params[k] != other.params[k]
        ]

    def describe(self) -> str:
        return ", ".join(
            f"{k} {_fmt(self.params[k])}" for k in self.KEYS if self.params[k] is not None
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, ParamTag) and other.descriptor == self.descriptor

    def __hash__(self) -> int:
        return hash(self.descriptor)


def seal_rows(rows: np.ndarray, public_key: PublicKey, tag: ParamTag) -> list[bytes]:
    """Each ``(bucket, sign)`` row as a sealed box for ``public_key``, with ``tag``'s
    fingerprint and one of its descriptor parts, the part drawn from the OS CSPRNG (a uniform
    byte mod 6: not uniform over the parts, but independent of the row, which is what matters)."""
    box = SealedBox(public_key)
    which = os.urandom(len(rows))
    fp, parts = tag.fingerprint, tag.parts
    return [
        box.encrypt(_PLAIN.pack(int(b), int(s), fp, w % DESC_PARTS, parts[w % DESC_PARTS]))
        for (b, s), w in zip(rows.tolist() if isinstance(rows, np.ndarray) else rows, which)
    ]


@dataclass
class Opened:
    """Decrypted messages: ``rows`` (m, 2) int64 (bucket, sign); per message its
    ``fingerprints`` (uint64), descriptor ``part`` index and descriptor ``chunk`` (uint64)."""

    rows: np.ndarray
    fingerprints: np.ndarray
    part: np.ndarray
    chunk: np.ndarray


def _unpack(plain: bytes, m: int) -> Opened:
    rec = np.frombuffer(plain, dtype=PLAIN_DTYPE, count=m)
    rows = np.empty((m, 2), dtype=np.int64)
    rows[:, 0] = rec["bucket"]
    rows[:, 1] = rec["sign"]
    return Opened(rows, rec["fingerprint"].copy(), rec["part"].copy(), rec["chunk"].copy())


def open_messages(boxes, private_key: PrivateKey) -> Opened:
    """Decrypt sealed boxes; a box that fails (or opens to another size) raises WireError."""
    sk, pk = bytes(private_key), bytes(private_key.public_key)
    out = bytearray()
    for c in boxes:
        try:
            plain = crypto_box_seal_open(bytes(c), pk, sk)
        except CryptoError:
            raise WireError(
                "a message does not decrypt with the analyzer's key "
                "(sealed to another key, or corrupted)"
            ) from None
        if len(plain) != PLAIN_SIZE:
            raise WireError(f"a decrypted message has {len(plain)} bytes, not {PLAIN_SIZE}")
        out += plain
    return _unpack(bytes(out), len(boxes))


# -- decryption over worker processes ----------------------------------------------------------
#: env var: helper processes for the analyzer's decryption, beside its own (0: none; default:
#: the CPUs this process may run on, minus one)
WORKERS_ENV = "PANAGG_SHUFFLE_DECRYPT_WORKERS"
#: chunks smaller than this are opened in the calling process (the workers' round trip costs
#: more than it saves there; the shuffler writes 5,000-box chunks)
POOL_MIN_BOXES = 2_500


def default_workers(env=None) -> int:
    env = os.environ if env is None else env
    text = str(env.get(WORKERS_ENV, "")).strip()
    if text:
        try:
            return max(0, int(text))
        except ValueError:
            raise WireError(f"{WORKERS_ENV} must be a whole number of worker processes") from None
    try:
        return len(os.sched_getaffinity(0)) - 1
    except AttributeError:  # not Linux
        return (os.cpu_count() or 1) - 1


def _read_exactly(stream, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        got = stream.read(size - len(buf))
        if not got:
            raise EOFError
        buf += got
    return bytes(buf)


def _worker_main() -> None:
    """A decryption worker (:class:`BoxOpener`): on stdin the 32-byte private key, then
    requests ``<u4 m>`` + ``m`` concatenated sealed boxes; on stdout per request ``b"\\x01"`` +
    the ``m`` plaintexts, or ``b"\\x00"`` if a box does not open (the chunk is rejected whole)."""

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        sk = _read_exactly(inp, 32)
        pk = bytes(PrivateKey(sk).public_key)
        while True:
            m = int.from_bytes(_read_exactly(inp, 4), "little")
            data = _read_exactly(inp, m * SEALED_SIZE)
            try:
                plain = b"".join(
                    crypto_box_seal_open(data[i : i + SEALED_SIZE], pk, sk)
                    for i in range(0, len(data), SEALED_SIZE)
                )
                ok = len(plain) == m * PLAIN_SIZE
            except CryptoError:
                ok = False
            out.write(b"\x01" + plain if ok else b"\x00")
            out.flush()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return


class BoxOpener:
    """Opens sealed boxes with one private key, a chunk's boxes split between this process and
    ``workers`` helper processes (:func:`_worker_main`, started once as ``python -c``, fed
    through pipes: no ``multiprocessing``, which would re-import the caller's main module, and
    no fork of a process holding Kafka client threads). Each box costs one X25519 scalar
    multiplication (its own ephemeral key: the messages must stay unlinkable), so decryption is
    CPU-bound and scales with free cores, not with batching. The workers get the private key
    once, on their stdin; they never see anything but boxes."""

    def __init__(self, private_key: PrivateKey, workers: int | None = None):
        self.key = private_key
        self.workers = default_workers() if workers is None else int(workers)
        self._procs: list = []

    def _start(self) -> list:
        if not self._procs:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(
                    [root] + [p for p in [os.environ.get("PYTHONPATH", "")] if p]
                ),
            )
            for _ in range(self.workers):
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        "from aggregator.service.shuffle_wire import _worker_main; _worker_main()",
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    close_fds=True,
                )
                proc.stdin.write(bytes(self.key))
                proc.stdin.flush()
                self._procs.append(proc)
        return self._procs

    def open(self, boxes) -> Opened:
        """As :func:`open_messages` (raises WireError if any box does not open)."""
        m = len(boxes)
        if self.workers < 1 or m < POOL_MIN_BOXES:
            return open_messages(boxes, self.key)
        if any(len(b) != SEALED_SIZE for b in boxes):
            raise WireError(f"a box is not {SEALED_SIZE} bytes")
        procs = self._start()
        w = len(procs) + 1  # the last slice is opened here meanwhile
        cuts = [i * m // w for i in range(w + 1)]
        try:
            for j, proc in enumerate(procs):  # the workers read whole requests: no deadlock
                part = boxes[cuts[j] : cuts[j + 1]]
                proc.stdin.write((len(part)).to_bytes(4, "little") + b"".join(part))
                proc.stdin.flush()
            try:
                mine = open_messages(boxes[cuts[-2] :], self.key)
            except WireError:
                mine = None
            replies = []
            for j, proc in enumerate(procs):
                ok = _read_exactly(proc.stdout, 1)
                replies.append(
                    _read_exactly(proc.stdout, (cuts[j + 1] - cuts[j]) * PLAIN_SIZE)
                    if ok == b"\x01"
                    else None
                )
        except (EOFError, BrokenPipeError, OSError):
            self.close()  # a worker died: start afresh next time, open this chunk here
            return open_messages(boxes, self.key)
        if mine is None or any(r is None for r in replies):
            raise WireError(
                "a message does not decrypt with the analyzer's key "
                "(sealed to another key, or corrupted)"
            )
        theirs = _unpack(b"".join(replies), cuts[-2])
        return Opened(
            *(
                np.concatenate([a, b])
                for a, b in zip(
                    (theirs.rows, theirs.fingerprints, theirs.part, theirs.chunk),
                    (mine.rows, mine.fingerprints, mine.part, mine.chunk),
                )
            )
        )

    def close(self) -> None:
        for proc in self._procs:
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except Exception:  # best effort: a worker that does not exit is killed
                proc.kill()
        self._procs = []


def open_boxes(boxes, private_key: PrivateKey) -> np.ndarray:
    """Decrypt sealed boxes to an (m, 2) int64 array of (bucket, sign) (fingerprints dropped:
    :func:`open_messages` keeps them); a box that fails raises WireError."""
    return open_messages(boxes, private_key).rows


def new_event_id() -> bytes:
    return secrets.token_bytes(EVENT_ID_SIZE)


def client_record(boxes: list[bytes]) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "boxes": boxes}, use_bin_type=True)


def parse_client_record(value: bytes) -> list[bytes]:
    try:
        doc = msgpack.unpackb(value, raw=False)
    except Exception:
        raise WireError("client record is not msgpack") from None
    if (
        not isinstance(doc, dict)
        or doc.get("v") != WIRE_VERSION
        or not isinstance(doc.get("boxes"), list)
    ):
        raise WireError(f"client record is not a v{WIRE_VERSION} {{'v', 'boxes'}} map")
    boxes = doc["boxes"]
    if not boxes or not all(isinstance(b, bytes) and len(b) == SEALED_SIZE for b in boxes):
        raise WireError(f"client record's boxes must be non-empty and {SEALED_SIZE} bytes each")
    return boxes


def chunk_record(window: int, boxes: list[bytes]) -> bytes:
    return msgpack.packb(
        {"v": WIRE_VERSION, "window": int(window), "boxes": boxes}, use_bin_type=True
    )


def end_record(
    window: int, events: int, topped_up: int, messages: int, params: dict | None = None
) -> bytes:
    doc = {
        "v": WIRE_VERSION,
        "window": int(window),
        "end": True,
        "events": int(events),
        "topped_up": int(topped_up),
        "messages": int(messages),
    }
    if params is not None:  # the shuffler's randomizer parameters (PARAM_KEYS), informational
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
    if (
        not isinstance(doc, dict)
        or doc.get("v") != WIRE_VERSION
        or not isinstance(doc.get("window"), int)
    ):
        raise WireError(f"analyzer record is not a v{WIRE_VERSION} chunk or end marker")
    if doc.get("end") is True:
        return doc
    if not isinstance(doc.get("boxes"), list):
        raise WireError("analyzer chunk has no boxes")
    return doc
