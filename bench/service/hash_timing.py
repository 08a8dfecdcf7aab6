"""Timing side channel of hashed counting: how much one event changes the time to hash its batch.

The service counts a decoded batch with one ``bucket_of(items, key, B)`` call, and consumer lag and
rates show how long that took. This bench times that call on a batch of ``--n`` short ASCII items
(``user-<i>``) and on the same batch with one item replaced (a long item, a non-ASCII item, an
item with a NUL, ...), all in one process, interleaved (a new random order every repetition), and
reports for each variant the median time, the throughput, and the median over repetitions of the
paired difference and ratio to the plain batch. The "A/A" row times an identical copy of the plain
batch: its difference is the noise floor of this measurement, its spread the batch-time jitter.

``--rev REV`` times ``aggregator/hashing.py`` (and ``consumers/decode.py``) as they were at that
git revision (the before column). ``--decode`` also times ``Decoder("msgpack").decode`` on such a
batch as messages (a long valid item, an oversized one, an undecodable record). ``--options``
also times the rejected alternative, every item padded to ``--item-bytes`` (fixed cost per item),
on the plain batch and with the long item. ``--crossover`` times k long rows through numpy steps
against word by word in Python, which sets ``hashing._SCALAR_ROWS``.

    nice -n 10 .venv/bin/python -m bench.service.hash_timing --decode --options --crossover
    nice -n 10 .venv/bin/python -m bench.service.hash_timing --decode --rev c70a57e
"""

from __future__ import annotations

import gc
import importlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from itertools import repeat

import numpy as np

from bench.harness import ROOT, parser


def load(name: str, rev: str | None) -> types.ModuleType:
    """Module ``name`` (e.g. aggregator.hashing) from the work tree, or its file as it was at git
    revision ``rev``."""
    if rev is None:
        return importlib.import_module(name)
    path = name.replace(".", "/") + ".py"
    src = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    mod = types.ModuleType(f"{name}_at_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up there
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def decode_batches(n: int, item_bytes: int) -> dict[str, list[bytes]]:
    """msgpack messages {"item": ...}: the plain batch and variants that differ in one message."""
    import msgpack

    base = [msgpack.packb({"item": f"user-{i}"}) for i in range(10_000, 10_000 + n)]
    k = n // 2

    def one(raw):
        b = list(base)
        b[k] = raw
        return b

    return {
        "plain": base,
        "A/A (identical copy)": list(base),
        "one item of 300 characters (valid)": one(msgpack.packb({"item": "u" * 300})),
        f"one item of {item_bytes} B (valid)": one(msgpack.packb({"item": "u" * item_bytes})),
        f"one item of {item_bytes + 1} B (oversized)": one(
            msgpack.packb({"item": "u" * (item_bytes + 1)})
        ),
        "one undecodable record": one(b"\xc1"),
    }


def batches(n: int, item_bytes: int) -> dict[str, list]:
    """The plain batch and variants that differ from it in one item (the middle one)."""
    base = [f"user-{i}" for i in range(10_000, 10_000 + n)]
    k = n // 2

    def one(item):
        b = list(base)
        b[k] = item
        return b

    out = {"plain": base, "A/A (identical copy)": list(base)}
    for length in (64, 256, item_bytes):
        out[f"one ASCII item of {length} B"] = one("u" * length)
    out["one non-ASCII item (usér-..., 11 B)"] = one(base[k].replace("e", "é"))
    out["one item with a NUL inside (10 B)"] = one(base[k].replace("-", "\x00"))
    out[f"one non-ASCII item of {item_bytes} B"] = one("é" * (item_bytes // 2))
    ints = list(range(10**9, 10**9 + n))
    out["ints (plain int batch)"] = ints
    big = list(ints)
    big[k] = 2**64 - 1
    out["ints, one of them 2**64-1"] = big
    return out


def padded_bucket_of(mod, items, key: bytes, buckets: int, item_bytes: int) -> np.ndarray:
    """Rejected option: every row runs item_bytes // 8 + 1 message words (fixed cost per item);
    a row past its own last word keeps its state, so the hashes stay SipHash's."""
    k0, k1 = mod._check_key(key)
    enc = mod._canonical(items)
    per_row = item_bytes // 8 + 1
    rows = len(enc)
    mat = (
        np.frombuffer(
            b"".join(map(bytes.ljust, enc, repeat(per_row * 8), repeat(b"\x00"))), dtype="<u8"
        )
        .reshape(rows, per_row)
        .astype(np.uint64, copy=False)
    )
    lengths = np.array(list(map(len, enc)), dtype=np.int64)
    nw = (lengths >> 3) + 1
    tail = (lengths.astype(np.uint64) & np.uint64(0xFF)) << np.uint64(56)
    zero = np.uint64(0)
    v = mod._init(k0, k1, rows)
    t = np.empty(rows, np.uint64)
    with np.errstate(over="ignore"):
        for b in range(per_row):
            m = mat[:, b] | np.where(nw == b + 1, tail, zero)
            new = [x.copy() for x in v]
            mod._compress(*new, m, t)
            running = nw > b
            v = [np.where(running, a, old) for a, old in zip(new, v)]
        h = mod._finish(*v, t)
    return (h % np.uint64(buckets)).astype(np.int64)


def crossover(mod, key: bytes, item_bytes: int, reps: int) -> list[str]:
    """Time k rows of item_bytes through numpy steps only and word by word in Python only: where
    they cross is the right ``_SCALAR_ROWS`` (below it the long rows finish in Python)."""
    k0, k1 = mod._check_key(key)
    saved = mod._SCALAR_ROWS
    lines = [
        f"| rows of {item_bytes} B | numpy steps | Python words | faster |",
        "|---:|---:|---:|---|",
    ]
    try:
        for k in (1, 2, 4, 8, 10, 12, 16, 24, 32):
            flat = mod._flat(["u" * item_bytes] * k)

            def run(limit, flat=flat):
                mod._SCALAR_ROWS = limit
                mod._sip_flat(k0, k1, *flat)

            t = time_interleaved({"numpy": lambda: run(0), "python": lambda: run(10**9)}, reps)
            a, b = statistics.median(t["numpy"]), statistics.median(t["python"])
            lines.append(
                f"| {k} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {'numpy' if a < b else 'Python'} |"
            )
    finally:
        mod._SCALAR_ROWS = saved
    return lines


def time_interleaved(calls: dict, reps: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per call, ``reps`` times each, in a fresh random order every repetition (a fixed
    rotation would always run a variant right after the same neighbour, whose cache state it
    inherits); a call that raises is recorded as the exception's type name instead of times."""
    names = list(calls)
    times: dict[str, list[float] | str] = {k: [] for k in names}
    shuffle = random.Random(0).shuffle  # the order is not secret; a fixed seed repeats the run
    for r in range(warmup + reps):
        order = list(names)
        shuffle(order)
        for k in order:
            if isinstance(times[k], str):
                continue
            gc.collect()
            gc.disable()  # a collection inside one call would be charged to that variant
            try:
                t0 = time.perf_counter()
                calls[k]()
                dt = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - the old code's OverflowError is a result
                times[k] = type(exc).__name__
                continue
            finally:
                gc.enable()
            if r >= warmup:
                times[k].append(dt)
    return times


def q(xs, p):
    return float(np.percentile(xs, p))


def report(times: dict, n: int, ref: dict[str, str]) -> list[str]:
    """Markdown rows: each variant against its reference (paired by repetition)."""
    lines = [
        "| batch | median | items/s | one-item effect: median paired diff (IQR) | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, ts in times.items():
        if isinstance(ts, str):
            lines.append(f"| {k} | raises {ts} | — | — | — |")
            continue
        med = statistics.median(ts)
        row = f"| {k} | {med * 1e3:.2f} ms | {n / med / 1e6:.2f} M |"
        base = times.get(ref.get(k, ""))
        if base is None or isinstance(base, str):
            lines.append(row + " (reference) | — |")
            continue
        d = [(a - b) * 1e6 for a, b in zip(ts, base)]
        r = [a / b for a, b in zip(ts, base)]
        lines.append(
            row + f" {statistics.median(d):+.0f} µs ({q(d, 25):+.0f} .. {q(d, 75):+.0f})"
            f" | {statistics.median(r):.3f}x |"
        )
    return lines


def main(argv=None) -> int:
    ap = parser(__doc__, "--n 1000 --reps 3 --decode --options --crossover")
    ap.add_argument("--n", type=int, default=20_000, help="items per batch")
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--buckets", type=int, default=2**20)
    ap.add_argument("--item-bytes", type=int, default=1024, help="the decoder's max_item_bytes")
    ap.add_argument("--rev", default=None, help="time aggregator/hashing.py at this git revision")
    ap.add_argument(
        "--options", action="store_true", help="also time the pad-every-item-to --item-bytes option"
    )
    ap.add_argument(
        "--decode",
        action="store_true",
        help="also time Decoder.decode (msgpack) on message batches like these",
    )
    ap.add_argument(
        "--crossover",
        action="store_true",
        help="also time k long rows in numpy steps vs Python words (_SCALAR_ROWS)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.reps, args.decode, args.options, args.crossover = 1000, 3, True, True, True

    mod = load("aggregator.hashing", args.rev)
    if (args.options or args.crossover) and not hasattr(mod, "_canonical"):
        ap.error("--options / --crossover need the work-tree hashing.py (its kernel pieces)")
    key = os.urandom(16)
    data = batches(args.n, args.item_bytes)
    calls = {k: (lambda b=b: mod.bucket_of(b, key, args.buckets)) for k, b in data.items()}
    ref = {k: "plain" for k in data if k != "plain" and not k.startswith("ints")}
    ref["ints, one of them 2**64-1"] = "ints (plain int batch)"
    if args.options:
        for k in ("plain", f"one ASCII item of {args.item_bytes} B"):
            want = mod.bucket_of(data[k], key, args.buckets)
            got = padded_bucket_of(mod, data[k], key, args.buckets, args.item_bytes)
            assert np.array_equal(got, want), "padded option must give the same buckets"
            name = f"padded to {args.item_bytes} B: {k}"
            calls[name] = lambda b=data[k]: padded_bucket_of(
                mod, b, key, args.buckets, args.item_bytes
            )
            ref[name] = f"padded to {args.item_bytes} B: plain" if k != "plain" else "plain"
    times = time_interleaved(calls, args.reps)

    cmd = " ".join(
        ["python -m bench.service.hash_timing"] + list(sys.argv[1:] if argv is None else argv)
    )
    print(
        f"# bench.service.hash_timing: bucket_of on {args.n} items, B = {args.buckets}, "
        f"{args.reps} interleaved repetitions"
    )
    print(
        f"hashing.py: {source(args.rev)}; python {platform.python_version()}, numpy "
        f"{np.__version__}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; command: {cmd}"
    )
    print()
    print("\n".join(report(times, args.n, ref)))
    plain, aa = times["plain"], times["A/A (identical copy)"]
    if isinstance(plain, str):
        return 0
    d = [(a - b) * 1e6 for a, b in zip(aa, plain)]
    print()
    print(
        f"jitter: plain batch {statistics.median(plain) * 1e3:.2f} ms, IQR "
        f"{(q(plain, 75) - q(plain, 25)) * 1e6:.0f} µs, 5-95% {q(plain, 5) * 1e3:.2f} .. "
        f"{q(plain, 95) * 1e3:.2f} ms; A/A paired diff IQR {q(d, 25):+.0f} .. "
        f"{q(d, 75):+.0f} µs; "
        f"per plain item {statistics.median(plain) / args.n * 1e9:.0f} ns"
    )
    short, long_ = times["one ASCII item of 64 B"], times[f"one ASCII item of {args.item_bytes} B"]
    if not isinstance(short, str) and not isinstance(long_, str):
        slope = statistics.median([(a - b) * 1e9 for a, b in zip(long_, short)]) / (
            args.item_bytes - 64
        )
        print(
            f"one item's own length: {slope:.0f} ns per byte (median paired difference of the "
            f"{args.item_bytes} B and 64 B rows over {args.item_bytes - 64} bytes)"
        )
    if args.decode:
        dec_mod = load("consumers.decode", args.rev)
        dec = dec_mod.Decoder("msgpack", max_item_bytes=args.item_bytes)
        msgs = decode_batches(args.n, args.item_bytes)
        t = time_interleaved({k: (lambda b=b: dec.decode(b)) for k, b in msgs.items()}, args.reps)
        print()
        print(
            "Decoder('msgpack').decode, consumers/decode.py: "
            f"{source(args.rev, 'consumers/decode.py')}"
        )
        print()
        print("\n".join(report(t, args.n, {k: "plain" for k in msgs if k != "plain"})))
    if args.crossover:
        print()
        print(f"hashing._SCALAR_ROWS = {mod._SCALAR_ROWS}")
        print("\n".join(crossover(mod, key, args.item_bytes, args.reps)))
    return 0


def source(rev: str | None, path: str = "aggregator/hashing.py") -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    if rev is not None:
        return f"git {git('rev-parse', '--short', rev)}"
    dirty = " + uncommitted changes" if git("status", "--porcelain", path) else ""
    return f"work tree at {git('rev-parse', '--short', 'HEAD')}{dirty}"


if __name__ == "__main__":
    sys.exit(main())
