"""``panagg``: command-line entry point.

Subcommands present now: ``demo`` (synthetic login events -> pan-private state -> release files,
no Kafka). Errors a user can fix print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

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
