"""``panagg``: command-line entry point.

Subcommands present now: ``demo`` (synthetic login events -> pan-private state -> release files,
no Kafka) and ``central`` (a trusted curator's file of counts -> central-model DP release).
Errors a user can fix print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

__all__ = ["main"]


class UsageError(Exception):
    """A mistake the user can fix from the message alone."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _progress(done: int, total: int, started: float) -> None:
    if not sys.stderr.isatty() and done < total:
        return
    rate = done / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(f"\r  {done:,}/{total:,} events ({100 * done / max(total, 1):.0f}%, "
                     f"{rate:,.0f} events/s)")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_demo(args: argparse.Namespace) -> int:
    from consumers.generator import ZipfLogins

    from .release import make_release, write_release
    from .state import PanPrivateHistogram

    windows = args.windows
    per_window = args.events // windows
    if per_window < 1:
        raise UsageError(f"--events {args.events} is fewer than --windows {windows}; "
                         "give at least one event per window")
    print(f"panagg demo: {args.events:,} synthetic logins over {args.accounts:,} accounts "
          f"(Zipf {args.zipf}), eps={args.epsilon}, model={args.model}, {windows} window(s)")
    for w in range(windows):
        state = PanPrivateHistogram(epsilon=args.epsilon, size=args.accounts)
        gen = ZipfLogins(events=per_window + (args.events % windows if w == windows - 1 else 0),
                         accounts=args.accounts, s=args.zipf)
        started = time.perf_counter()
        for batch in gen.iter_batches():
            state.update(batch)
            _progress(state.n, gen.events, started)
        release = make_release(state, model=args.model, window=w)
        path = write_release(release, args.output)
        p = release["properties"]
        print(f"window {w}: n={release['n']:,} released {p['distinct_items']:,} items, "
              f"entropy {p['entropy_nats']:.3f} nats ({release['release_seconds']:.2f}s) -> {path}")
    return 0


def read_histogram_file(path: str):
    """("counts", int array) or ("prevalences", [(r, phi_r), ...]) from a CSV or JSON file.

    JSON: a list of counts, {"counts": [...]}, {"prevalences": [[r, phi_r], ...]}, or a panagg
    release ({"histogram": {"pairs": ...}}). CSV: one column of counts, or two columns r, phi_r;
    a header line is allowed.
    """
    import csv
    import json
    from pathlib import Path

    import numpy as np

    text = Path(path).read_text()
    if path.endswith(".json") or text.lstrip().startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON (line {exc.lineno}): {exc.msg}") from None
        if isinstance(doc, dict) and "histogram" in doc:
            doc = {"prevalences": doc["histogram"].get("pairs", [])}
        if isinstance(doc, list):
            doc = {"counts": doc}
        if not isinstance(doc, dict) or not ({"counts", "prevalences"} & set(doc)):
            raise UsageError(f"{path}: expected a list of counts, {{\"counts\": [...]}} or "
                             "{\"prevalences\": [[r, phi_r], ...]}")
        kind = "counts" if "counts" in doc else "prevalences"
        rows = doc[kind]
    else:
        rows = [row for row in csv.reader(text.splitlines()) if row and any(c.strip() for c in row)]
        if rows and not all(_is_int(c) for c in rows[0]):
            rows = rows[1:]  # header
        widths = {len(r) for r in rows}
        if widths - {1, 2} or len(widths) > 1:
            raise UsageError(f"{path}: CSV must have one column (counts) or two (r, phi_r) on "
                             "every line")
        kind = "counts" if widths == {1} else "prevalences"
        rows = [r[0] for r in rows] if kind == "counts" else rows
    try:
        arr = np.asarray(rows, dtype=np.int64) if rows else np.zeros(0, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        raise UsageError(f"{path}: every {kind} entry must be a whole number") from None
    if kind == "prevalences" and arr.size and (arr.ndim != 2 or arr.shape[1] != 2):
        raise UsageError(f"{path}: prevalences must be pairs [r, phi_r]")
    if np.any(arr < 0):
        raise UsageError(f"{path}: counts and prevalences must be non-negative")
    return kind, arr


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def cmd_central(args: argparse.Namespace) -> int:
    from . import central
    from .release import package_release, write_release

    kind, arr = read_histogram_file(args.input)
    algorithm = args.algorithm
    if algorithm == "auto":
        algorithm = "dpanonhist" if args.epsilon >= 1 else "privhist"
    if algorithm == "dpanonhist" and args.epsilon < 1:
        raise UsageError("dpanonhist needs --epsilon >= 1; use --algorithm privhist below 1")
    started = time.perf_counter()
    if algorithm == "dpanonhist":
        counts = arr if kind == "counts" else np.repeat(arr[:, 0], arr[:, 1])
        hist = central.dp_anon_hist(counts, args.epsilon, n=args.public_n)
    else:
        hist = (central.privhist(arr, args.epsilon) if kind == "counts"
                else central.privhist(prevalences=arr.tolist(), epsilon=args.epsilon))
    release = package_release(
        hist, window=args.name, n=None, epsilon=args.epsilon,
        neighbor="anonymized histograms at l1 distance 1 (one item's count +-1)",
        model="central", extra={"algorithm": algorithm,
                                "public_n": args.public_n if algorithm == "dpanonhist" else None})
    release["release_seconds"] = time.perf_counter() - started
    path = write_release(release, args.output)
    print(f"central {algorithm} eps={args.epsilon}: released {len(hist):,} items, "
          f"n_hat={int(hist.sum()):,} -> {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="panagg", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the full pipeline on synthetic login events (no Kafka)")
    demo.add_argument("--events", type=_positive_int, default=1_000_000, help="events in total")
    demo.add_argument("--accounts", type=_positive_int, default=100_000, help="domain size D")
    demo.add_argument("--zipf", type=_positive_float, default=1.1, help="Zipf exponent")
    demo.add_argument("--epsilon", type=_positive_float, default=1.0, help="privacy parameter")
    demo.add_argument("--model", choices=("joint", "state-only"), default="joint")
    demo.add_argument("--windows", type=_positive_int, default=1, help="tumbling windows")
    demo.add_argument("--output", default="out/releases", help="directory for release files")
    demo.set_defaults(func=cmd_demo)
    cen = sub.add_parser("central", help="central-model DP release of a file of counts "
                                         "(trusted curator)")
    cen.add_argument("--input", required=True, help="CSV or JSON of counts or prevalences")
    cen.add_argument("--epsilon", type=_positive_float, required=True)
    cen.add_argument("--algorithm", choices=("auto", "dpanonhist", "privhist"), default="auto",
                     help="auto: DPAnonHist (Manurangsi) for eps >= 1, else PRIVHIST (Suresh)")
    cen.add_argument("--public-n", type=_positive_int, default=None,
                     help="a PUBLIC bound on the number of events (DPAnonHist only; otherwise "
                          "n is estimated privately)")
    cen.add_argument("--name", default="central", help="release name (file stem suffix)")
    cen.add_argument("--output", default="out/releases", help="directory for release files")
    cen.set_defaults(func=cmd_central)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"panagg: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"panagg: error: {exc.strerror or exc} ({exc.filename or ''}); check the path "
              "and its permissions", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
