"""The hot path's cost of choosing the item ([item], docs/configuration.md): decode + count of one
batch, with a field path, a filter, the record key or a header, against ``{"item": ...}``.

    .venv/bin/python -m bench.service.item_path [--n 100000] [--batch 20000] [--reps 21]

Each case is timed on the same machine, interleaved with its baseline (the order rotates every
repetition), and reported as throughput relative to the baseline: the median of the per-repetition
ratios, with min and max, and the ratio of the best (least disturbed) repetitions. Times are the
process's CPU time (``time.process_time``; the work is single-threaded), so other processes
competing for the cores do not enter the ratio. Two kinds of comparison:

* extraction only: the *same* records (``{"item": i, "user": {"id": i}, "event": ..., "ts": ...}``)
  decoded with ``item.field = item`` (the baseline) and with ``item.field = user.id`` (or a filter
  that lets every record through); only the extraction differs;
* schema: realistic login records decoded with ``user.id`` against minimal ``{"item": i}``
  records (parsing the bigger records is the larger part of that difference).

Counting is the real state (direct D = 100000, hashed B = 2**18). Prints a Markdown table (for
docs/item_selection.md).
"""

from __future__ import annotations

import gc
import platform
import statistics
import sys
import time

import msgpack
import numpy as np

from aggregator.state import PanPrivateHistogram
from bench.harness import parser, versions
from consumers.decode import FILTERED, Decoder, ItemSpec

D, B = 100_000, 1 << 18


def records(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    ids = rng.zipf(1.1, n) % D
    events = rng.choice(["login", "logout", "view"], n, p=[0.6, 0.2, 0.2])
    full = [
        msgpack.packb(
            {
                "item": int(i),
                "user": {"id": int(i), "name": f"u{i}"},
                "event": str(e),
                "ts": 1700000000 + k,
            }
        )
        for k, (i, e) in enumerate(zip(ids, events))
    ]
    login_only = [
        msgpack.packb(
            {"user": {"id": int(i), "name": f"u{i}"}, "event": "login", "ts": 1700000000 + k}
        )
        for k, i in enumerate(ids)
    ]
    minimal = [msgpack.packb({"item": int(i)}) for i in ids]
    keys = [str(int(i)).encode() for i in ids]
    headers = [[("device", f"d{int(i)}".encode())] for i in ids]
    texts = [msgpack.packb({"user": {"id": f"Usér-{int(i)}"}, "event": "login"}) for i in ids]
    return full, login_only, minimal, keys, headers, texts


def pipeline(decoder: Decoder, values, batch: int, direct: bool, keys=None, headers=None):
    def run():
        state = (
            PanPrivateHistogram(1.0, size=D, rng=np.random.default_rng(0))
            if direct
            else PanPrivateHistogram(1.0, buckets=B, rng=np.random.default_rng(0))
        )
        counted = 0
        for lo in range(0, len(values), batch):
            out = decoder.decode(
                values[lo : lo + batch],
                None if keys is None else keys[lo : lo + batch],
                None if headers is None else headers[lo : lo + batch],
            )
            bad = [r for r in out.rejected if r[1] != FILTERED]
            assert not bad, bad[:3]
            if direct:
                state.add_indices(np.asarray(out.items, dtype=np.int64))
            else:
                state.update(out.items)
            counted += len(out.items)
        return counted

    return run


def cpu_times(competitors: dict, reps: int) -> dict:
    """CPU seconds of each competitor per repetition, the order rotating every repetition."""
    names = list(competitors)
    times = {k: [] for k in names}
    for r in range(reps):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            gc.disable()
            try:
                t0 = time.process_time()
                competitors[k]()
                times[k].append(time.process_time() - t0)
            finally:
                gc.enable()
    return times


def main(argv=None) -> int:
    ap = parser(__doc__, "--n 2000 --batch 1000 --reps 1")
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.batch, args.reps = 2000, 1000, 1
    full, login_only, minimal, keys, headers, texts = records(args.n)
    path = ItemSpec(path=("user", "id"))
    cases = []  # (mode, what, baseline, case)
    for mode in ("direct", "hashed"):
        direct = mode == "direct"
        dom = D if direct else None
        base_same = pipeline(Decoder(domain_size=dom), full, args.batch, direct)
        cases.append(
            (
                mode,
                "extraction: user.id vs item, same records",
                base_same,
                pipeline(Decoder(domain_size=dom, spec=path), full, args.batch, direct),
            )
        )
        filt = ItemSpec(path=("user", "id"), filter_path=("event",), filter_value="login")
        cases.append(
            (
                mode,
                "extraction + filter event=login (60 % pass) vs item, same records",
                base_same,
                pipeline(Decoder(domain_size=dom, spec=filt), full, args.batch, direct),
            )
        )
        cases.append(
            (
                mode,
                'schema: login records via user.id vs {"item": i}',
                pipeline(Decoder(domain_size=dom), minimal, args.batch, direct),
                pipeline(Decoder(domain_size=dom, spec=path), login_only, args.batch, direct),
            )
        )
        if not direct:
            base_min = pipeline(Decoder(), minimal, args.batch, False)
            cases.append(
                (
                    mode,
                    'record key vs {"item": i} value',
                    base_min,
                    pipeline(
                        Decoder(spec=ItemSpec(source="key")), minimal, args.batch, False, keys=keys
                    ),
                )
            )
            cases.append(
                (
                    mode,
                    'header vs {"item": i} value',
                    base_min,
                    pipeline(
                        Decoder(spec=ItemSpec(source="header", header="device")),
                        minimal,
                        args.batch,
                        False,
                        headers=headers,
                    ),
                )
            )
            cases.append(
                (
                    mode,
                    'user.id + NFC + casefold vs user.id, text ids ("Usér-123")',
                    pipeline(Decoder(spec=path), texts, args.batch, False),
                    pipeline(
                        Decoder(spec=ItemSpec(path=("user", "id"), nfc=True, casefold=True)),
                        texts,
                        args.batch,
                        False,
                    ),
                )
            )
    print(
        f"n = {args.n:,} records per run, batches of {args.batch:,}, {args.reps} interleaved "
        f"repetitions; {versions(['numpy', 'msgpack'])}; {platform.machine()}\n"
    )
    print(
        "| mode | case | baseline (M records per CPU-s) | case (M records per CPU-s) | "
        "throughput vs baseline: median of paired ratios (min-max) | best vs best |"
    )
    print("|---|---|---|---|---|---|")
    for mode, what, base, ours in cases:
        times = cpu_times({"base": base, "ours": ours}, args.reps)
        ratios = [b / o for b, o in zip(times["base"], times["ours"])]  # throughput ratio
        med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
        tb, to = statistics.median(times["base"]), statistics.median(times["ours"])
        print(
            f"| {mode} | {what} | {args.n / tb / 1e6:.2f} | {args.n / to / 1e6:.2f} | "
            f"{med:.2f}x ({lo:.2f}-{hi:.2f}) | {min(times['base']) / min(times['ours']):.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
