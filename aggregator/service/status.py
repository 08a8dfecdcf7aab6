"""What a state directory is doing: ``panagg status`` and ``panagg history``.

``status`` answers an operator's first questions from the directory alone, read-only: is a
service running on it, what does it count, which window is open and how far along, how far
behind the stream it is, is it healthy, how much privacy budget is left, and what was released
last. The open window's progress exists only in the running service's memory (its counters are
never on disk, docs/privacy.md section 16), so it comes from that service's own metrics endpoint
(the URL it leaves in ``DIR/metrics.url``), parsed with prometheus-client's parser. Everything shown
is public: n, offsets and released statistics, never a counter.

``history`` lists the ledgered releases window by window (n, distinct items and entropy with their
intervals and expected errors, and whether each changed significantly since the previous release:
:mod:`aggregator.changes`) and can plot them across windows; the ledger is the authority on what
was released, so the list is the same whether or not the release files are still around.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from state_store.local import CheckpointError, LocalStore

from .. import changes
from ..release import PRIVACY_UNIT, PRIVACY_UNIT_CONSEQUENCE
from .ledger import Ledger, LedgerError, sibling_ledger_paths
from .multi import SET_FILE
from .stages.state_dir import service_running
from .user_budget import user_spent, windows_left
from .user_window import USER, USER_CONSEQUENCE, unit_clause

__all__ = [
    "StatusError",
    "collect_status",
    "format_status",
    "release_history",
    "format_history",
    "plot_history",
    "METRICS_URL_FILE",
]

METRICS_URL_FILE = "metrics.url"  # written by the service when it serves metrics


class StatusError(ValueError):
    """The directory cannot be described (no state there, a damaged ledger)."""


def _ledger(state_dir: Path) -> Ledger:
    path = state_dir / "ledger.jsonl"
    several = state_dir / "aggregations.json"  # aggregator.service.multi: one directory each
    if not path.exists() and several.exists():
        names = json.loads(several.read_text()).get("aggregations", [])
        raise StatusError(
            f"{state_dir} holds several aggregations ({', '.join(names)}); pass "
            f"--state-dir {state_dir}/NAME for one of them"
        )
    if not path.exists():
        raise StatusError(
            f"{state_dir} holds no panagg state (no ledger.jsonl); pass the "
            "--state-dir (checkpoint.dir) the service runs with"
        )
    try:
        return Ledger(path, budget_per_window=1.0)
    except LedgerError as exc:
        raise StatusError(str(exc)) from None


def _metrics_url(state_dir: Path) -> tuple[Path, str | None]:
    """The file holding the metrics URL of the service on ``state_dir``, and the aggregation
    label to read: one aggregation of several (rollups too) is served by the process on the
    parent directory, whose one exposition labels every series with its aggregation."""
    own = state_dir / METRICS_URL_FILE
    if not own.exists() and (state_dir.parent / "aggregations.json").exists():
        return state_dir.parent / METRICS_URL_FILE, state_dir.name
    return own, None


def _scrape(url: str, timeout_s: float = 2.0, aggregation: str | None = None) -> dict:
    """The running service's health, readiness and progress gauges (bounded: 2 s per call);
    ``aggregation``: only that aggregation's series."""

    base = url.rsplit("/metrics", 1)[0]
    out: dict = {}
    for path in ("healthz", "ready"):
        try:
            with urllib.request.urlopen(f"{base}/{path}", timeout=timeout_s) as resp:
                out[path] = (resp.status, resp.read().decode().strip())
        except urllib.error.HTTPError as exc:
            out[path] = (exc.code, exc.read().decode().strip())
        except (OSError, urllib.error.URLError) as exc:
            out[path] = (None, f"unreachable ({type(exc).__name__})")
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError):
        return out
    lag = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("aggregation", None) != aggregation:
                continue
            if sample.name == "panagg_consumer_lag_records":
                lag[labels.get("partition", "")] = sample.value
            elif not labels:
                out[sample.name] = sample.value
    out["lag"] = lag
    return out


def _sibling_user_charges(state_dir: Path) -> float:
    """What the other aggregations of ``state_dir``'s set charged every user (0 outside a
    set)."""
    if not (state_dir.resolve().parent / SET_FILE).exists():
        return 0.0
    return sum(
        user_spent(Ledger(path, budget_per_window=1.0).entries)
        for path in sibling_ledger_paths(state_dir)
    )


def collect_status(state_dir) -> dict:
    """The status of ``state_dir`` as a JSON-ready dict (see the module docstring)."""

    state_dir = Path(state_dir)
    ledger = _ledger(state_dir)
    identity = ledger.identity() or {}
    running = service_running(state_dir)
    status: dict = {
        "state_dir": str(state_dir),
        "identity": identity,
        "service": "running" if running else "not running",
    }
    try:
        ck = LocalStore(state_dir / "checkpoints").load_latest()
    except CheckpointError as exc:
        ck, status["checkpoint_error"] = None, str(exc)
    if ck is not None:
        status["window"] = {
            "id": ck.window.get("id"),
            "kind": ck.window.get("kind"),
            "size": ck.window.get("size"),
            "started_unix": ck.window.get("started_unix"),
            "events_at_checkpoint": ck.window.get("events", 0),
        }
        status["pending_releases"] = len(ck.pending)
        status["checkpoint_age_s"] = max(0.0, time.time() - ck.window.get("started_unix", 0))
    spent = ledger.spent()
    total = identity.get("budget_total") or None
    status["budget"] = {
        "spent": spent,
        "total": total,
        "remaining": None if total is None else max(0.0, total - spent),
        "per_window": identity.get("epsilon"),
    }
    if identity.get("unit") == "user" and identity.get("budget_per_user"):
        cap, eps, charged = (
            float(identity["budget_per_user"]),
            float(identity["epsilon"]),
            user_spent(ledger.entries),
        )
        # the other aggregations of the set (window.rollups' levels under the user unit) charge
        # the same users: their ledgers count (the gate sums them before each release)
        levels = _sibling_user_charges(state_dir)
        # (the registry's charges of other deployments are read at a release)
        status["budget"]["per_user"] = {
            "budget": cap,
            "spent": charged + levels,
            "levels": levels,
            "windows_left": windows_left(cap, charged + levels, eps),
        }
    status["privacy_unit"] = (
        {"unit": USER, "consequence": USER_CONSEQUENCE}
        if identity.get("unit") == USER
        else {"unit": PRIVACY_UNIT, "consequence": PRIVACY_UNIT_CONSEQUENCE}
    )
    history = release_history(ledger)
    status["releases"] = len(history)
    status["last_release"] = history[-1] if history else None
    status["refused"] = sum(1 for e in ledger.entries if e["kind"] == "refused")
    url_file, aggregation = _metrics_url(state_dir)
    if running and url_file.exists():
        scraped = _scrape(url_file.read_text().strip(), aggregation=aggregation)
        status["health"] = {
            k: {"code": v[0], "text": v[1]} for k, v in scraped.items() if k in ("healthz", "ready")
        }
        live = {}
        for key, name in (
            ("window_id", "panagg_window_id"),
            ("window_events", "panagg_window_events"),
            ("window_progress", "panagg_window_progress_ratio"),
            ("events_total", "panagg_events_total"),
            ("broker_connected", "panagg_broker_connected"),
            ("intake_paused", "panagg_intake_paused"),
        ):
            if name in scraped:
                live[key] = scraped[name]
        if "lag" in scraped:
            live["lag_records"] = scraped["lag"]
        status["live"] = live
    elif running:
        status["health"] = None  # metrics off (metrics.port = -1): nothing to ask
    return status


def _fmt_time(unix) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(unix)) if unix else "?"


def format_status(s: dict) -> list[str]:
    ident = s["identity"]
    lines = [f"panagg status of {s['state_dir']}", f"service: {s['service']}"]
    if ident:
        what = (
            f"distinct users in {ident.get('domain'):,} cells"
            if ident.get("unit") == "user"
            else f"{ident.get('mode')} mode over {ident.get('domain'):,} counters"
        )
        lines.append(
            f"counts: {ident.get('stream')} (group {ident.get('group') or '-'}), "
            f"{what}, eps "
            f"{ident.get('epsilon'):g} per window, {ident.get('window')} windows, "
            f"model {ident.get('model')}"
        )
    if s.get("privacy_unit"):
        lines.append(unit_clause(s["privacy_unit"]["unit"]))
    win = s.get("window")
    live = s.get("live") or {}
    if win:
        line = f"window: {win['id']} open since {_fmt_time(win['started_unix'])}"
        if "window_events" in live and live.get("window_id") == win["id"]:
            line += (
                f", {int(live['window_events']):,} events so far "
                f"({100 * live.get('window_progress', 0):.1f}%)"
            )
        elif s["service"] == "running":
            line += ", progress: in the running service's memory only (metrics off)"
        else:
            line += (
                ", progress: none on disk by design (the open window is replayed from the "
                "source at the next start)"
            )
        lines.append(line)
    if live.get("lag_records"):
        lag = live["lag_records"]
        lines.append(f"lag: {int(sum(lag.values())):,} records behind over {len(lag)} partition(s)")
    health = s.get("health")
    if health:
        lines.append(f"health: {health['healthz']['text']}; {health['ready']['text']}")
    if live.get("intake_paused") == 1:
        lines.append("intake: PAUSED (privacy budget spent)")
    b = s["budget"]
    lines.append(
        f"budget: eps {b['spent']:g} spent"
        + (
            f" of {b['total']:g} ({b['remaining']:g} left)"
            if b["total"] is not None
            else " (no total cap)"
        )
    )
    per_user = b.get("per_user")
    if per_user:
        levels = per_user.get("levels") or 0.0
        by = f"this ledger and the other rollup levels' ({levels:g})" if levels else "this ledger"
        lines.append(
            f"per-user budget: eps {per_user['spent']:g} of {per_user['budget']:g} "
            f"charged to every user by {by} ({per_user['windows_left']} more "
            "window(s); other deployments' are counted at each release)"
        )
    last = s.get("last_release")
    if last:
        lines.append(
            f"last release: window {last['window']} at {_fmt_time(last['time_unix'])}, "
            + _release_summary(last)
        )
    else:
        lines.append("last release: none yet")
    if s.get("pending_releases"):
        lines.append(
            f"pending: {s['pending_releases']} release(s) not yet published "
            "(retried by the service)"
        )
    if s.get("refused"):
        lines.append(f"refused: {s['refused']} release(s) refused by the ledger")
    if s.get("checkpoint_error"):
        lines.append(f"checkpoint: {s['checkpoint_error']}")
    return lines


def _interval(row: dict, key: str, fmt: str) -> str:
    iv = row.get(f"{key}_interval")
    return f" [{format(iv[0], fmt)}-{format(iv[1], fmt)}]" if iv else ""


def _expected(row: dict, key: str) -> str:
    rel = (row.get("expected_relative_error") or {}).get(key)
    return f" (expect +-{100 * rel:.1f}%)" if rel is not None else ""


def _release_summary(row: dict) -> str:
    n = "?" if row["n"] is None else f"{row['n']:,}"
    users = row.get("distinct_users")
    if users:  # a user-level release: distinct users, their interval and expected error
        lo, hi = users["interval"]
        rel = users.get("expected_relative_error")
        return (
            f"n={n}, distinct users {users['value']:,.0f} [{lo:,.0f}-"
            + ("inf" if hi is None else f"{hi:,.0f}")
            + "]"
            + (f" (expect +-{100 * rel:.1f}%)" if rel is not None else "")
        )
    text = (
        f"n={n}, distinct {row['distinct_items']:,}{_interval(row, 'distinct_items', ',.0f')}"
        f"{_expected(row, 'distinct_items')}"
        f", entropy {row['entropy_nats']:.3f}{_interval(row, 'entropy_nats', '.3f')}"
        f"{_expected(row, 'entropy_nats')}"
    )
    if row.get("signal_below_noise"):
        text += ", BELOW THE NOISE (distinct items could be off by 2x)"
    return text


def release_history(ledger: Ledger, level: float = changes.LEVEL) -> list[dict]:
    """One row per ledgered release (single process: ``release``; scale-out: the merged
    ``release-document``), in ledger order. From the second row on, ``change`` holds the test
    of the change against the previous release at ``level`` (:func:`aggregator.changes.compare`:
    per statistic the relative change, the smallest significant change, ``significant`` and
    ``direction`` +1 / 0 / -1)."""
    rows, last = [], {}  # series (None: the base windows; else the rollup span) -> last doc
    for e in ledger.entries:
        if e["kind"] not in ("release", "release-document", "rollup") or not e.get("document"):
            continue
        doc = json.loads(e["document"])
        series = e.get("rollup") if e["kind"] == "rollup" else None
        prev = last.get(series)
        props = doc.get("properties", {})
        acc = doc.get("accuracy") or {}
        iv = acc.get("intervals") or {}
        row = {
            "window": doc.get("window"),
            "window_start": doc.get("window_start"),
            "time_unix": e.get("time_unix"),
            "n": doc.get("n"),
            "distinct_items": props.get("distinct_items"),
            "entropy_nats": props.get("entropy_nats"),
            "distinct_items_interval": iv.get("distinct_items"),
            "entropy_nats_interval": iv.get("entropy_nats"),
            "interval_level": iv.get("level"),
            "expected_relative_error": acc.get("expected_relative_error"),
            "signal_to_noise": acc.get("signal_to_noise"),
            "signal_below_noise": doc.get("signal_below_noise"),
            "model": doc.get("model"),
            "epsilon": doc.get("epsilon"),
            "change": None,
        }
        if doc.get("distinct_users"):  # state.privacy_unit = user (aggregator/service/user_window)
            row["distinct_users"] = doc["distinct_users"]
        if series is not None:  # a rollup: compared with the previous rollup of its span
            ru = doc.get("rollup") or {}
            row["rollup"] = {
                "span": series,
                "windows": len(ru.get("windows", [])),
                "base_windows": ru.get("base_windows"),
                "complete": ru.get("complete"),
                "layers": doc.get("layers"),
            }
        if prev is not None and not row.get("distinct_users"):
            c = changes.compare(prev, doc, level=level)
            row["change"] = {
                "versus_window": prev.get("window"),
                "level": level,
                **{
                    k: {f: c[k][f] for f in ("relative", "threshold", "significant", "direction")}
                    for k in changes.STATISTICS
                },
            }
        rows.append(row)
        last[series] = doc
    return rows


def _change_text(row: dict) -> str:
    c = row.get("change")
    if not c:
        return ""
    parts = []
    for key, name in (("distinct_items", "distinct"), ("entropy_nats", "entropy")):
        d = c[key]
        if d["significant"] is None:
            parts.append(f"{name}: no error figure to test a change")
        elif d["significant"]:
            moved = f"{100 * d['relative']:+.1f}%" if d["relative"] is not None else "from 0"
            parts.append(f"{name} {moved} (significant)")
        else:
            parts.append(f"{name}: no significant change")
    what = "rollup" if row.get("rollup") else "window"
    return f"; vs {what} {c['versus_window']} at level {c['level']:g}: " + ", ".join(parts)


def format_history(rows: list[dict]) -> list[str]:
    """One line per release; a change against the previous release is named only when it is
    significant at the rows' level (:func:`release_history`), else "no significant change"."""
    if not rows:
        return ["no releases in the ledger yet"]
    return [
        (
            f"rollup {row['window']} ({row['rollup']['windows']} of "
            f"{row['rollup']['base_windows']} windows, 0 extra eps"
            f"{'' if row['rollup']['complete'] else ', INCOMPLETE'})"
            if row.get("rollup")
            else f"window {row['window']}"
        )
        + f" at {_fmt_time(row['time_unix'])}: {_release_summary(row)}{_change_text(row)}"
        for row in rows
    ]


def plot_history(rows: list[dict], path) -> None:
    """Distinct items and entropy across windows, their intervals as bands, and the significant
    changes marked (PNG). The x axis is the release time (UTC) of each window, or the window
    number relative to the first when no times are known: raw window numbers (time windows are
    numbered since the epoch, 59849607) do not read."""

    # only the plots need matplotlib: a run without them starts without it
    import matplotlib.dates as mdates  # noqa: PLC0415
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    rows = [r for r in rows if not r.get("rollup")] or rows  # rollups: a scale of their own
    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True)
    timed = all(r.get("time_unix") for r in rows)
    if timed:
        x = [datetime.fromtimestamp(r["time_unix"], tz=timezone.utc) for r in rows]
    else:
        first = rows[0]["window"] if isinstance(rows[0]["window"], int) else 0
        x = [
            (r["window"] - first) if isinstance(r["window"], int) else i for i, r in enumerate(rows)
        ]
    level = next((r["interval_level"] for r in rows if r.get("interval_level")), None)
    band = f"{100 * level:g}% interval" if level else "interval"
    for ax, key, label in (
        (axes[0], "distinct_items", "distinct items"),
        (axes[1], "entropy_nats", "entropy (nats)"),
    ):
        ax.plot(x, [r[key] for r in rows], marker="o", ms=3, label=label)
        lo = [r[f"{key}_interval"][0] if r.get(f"{key}_interval") else r[key] for r in rows]
        hi = [r[f"{key}_interval"][1] if r.get(f"{key}_interval") else r[key] for r in rows]
        ax.fill_between(x, lo, hi, alpha=0.25, step=None, label=band)
        for sign, marker, text in ((1, "^", "significant rise"), (-1, "v", "significant fall")):
            idx = [
                i
                for i, r in enumerate(rows)
                if r.get("change") and r["change"][key]["direction"] == sign
            ]
            if idx:
                ax.plot(
                    [x[i] for i in idx],
                    [rows[i][key] for i in idx],
                    marker,
                    color="C3",
                    ms=8,
                    ls="none",
                    label=text,
                )
        below = [i for i, r in enumerate(rows) if r.get("signal_below_noise")]
        if below:
            ax.plot(
                [x[i] for i in below], [rows[i][key] for i in below], "kx", label="below the noise"
            )
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if timed:
        loc = mdates.AutoDateLocator()
        axes[1].xaxis.set_major_locator(loc)
        axes[1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, tz=timezone.utc))
        axes[1].set_xlabel("release time (UTC)")
    else:
        axes[1].set_xlabel(f"window - {rows[0]['window']}")
    lvl = rows[-1]["change"]["level"] if rows[-1].get("change") else changes.LEVEL
    axes[0].set_title(
        f"windows {rows[0]['window']} .. {rows[-1]['window']}; changes marked when "
        f"significant at level {lvl:g}",
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(path)
