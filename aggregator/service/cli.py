"""``panagg``: command-line entry point.

Subcommands: ``run`` (the service), ``demo`` (synthetic login events through the same pipeline,
no Kafka), ``release`` (close the current window now), ``audit export|verify|show`` and ``central``
(a trusted curator's file of counts -> central-model DP release).
Errors a user can fix print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time

import numpy as np

from state_store.atomic import atomic_write

from .settings import Config

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


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
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
    sys.stderr.write(
        f"\r  {done:,}/{total:,} events ({100 * done / max(total, 1):.0f}%, {rate:,.0f} events/s)"
    )
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _one_line_library_errors(record) -> bool:
    """Logging filter: a Kafka client error that the client recovers from itself (a socket closed
    under a pending read, a reconnect) is logged with its traceback by kafka-python; operators get
    the message and the exception in one line instead, and our own tracebacks stay rare and loud."""
    if record.exc_info and record.name.split(".", 1)[0] == "kafka":
        exc = record.exc_info[1]
        record.msg = record.getMessage() + (
            "" if exc is None else f" ({type(exc).__name__}: {exc})"
        )
        record.args = None
        record.exc_info = record.exc_text = None
    return True


class _RepeatedLibraryLines:
    """Logging filter: a Kafka client line repeated within ``window_s`` (the client logs every
    reconnect attempt and metadata retry during an outage: dozens a minute) is shown once, and
    the next one after the window says how many were held back. panagg's own lines pass."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.seen: dict[tuple, list] = {}  # (logger, template) -> [first shown, held back]

    def __call__(self, record) -> bool:
        if record.name.split(".", 1)[0] != "kafka":
            return True
        key = (record.name, str(record.msg)[:80])
        now = time.monotonic()
        entry = self.seen.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return False
        held = entry[1] if entry else 0
        self.seen[key] = [now, 0]
        if held:
            record.msg = (
                f"{record.getMessage()} (and {held} like it in the last {self.window_s:.0f} s)"
            )
            record.args = None
        return True


#: kafka-python lines about a connection to a broker going or coming back, by their error
#: (class names and socket errors, as the client words them)
_CONNECTION_WORDS = (
    "KafkaConnectionError",
    "NodeNotReadyError",
    "RequestTimedOutError",
    "CoordinatorNotAvailableError",
    "ECONNREFUSED",
    "Connection refused",
    "Connection reset by peer",
    "Broken pipe",
    "socket disconnected",
    "No node available",
    "Marking the coordinator dead",
    "Connection lost",
)


def _handled_library_line(record) -> bool:
    """Handler filter: kafka-python lines about what the service handles and reports itself
    (issue 27) are left out; the rest of the library's lines pass.

    - A broker going away and coming back: every connection logs its abort, loss and refused
      reconnects (a dozen ERROR lines per broker restart). The service says "Kafka broker
      unreachable" / "reachable again" once each, sets panagg_broker_connected and reconnects;
      ``-v`` shows the client's own lines too. An abort for another reason (a protocol error,
      TLS) still shows.
    - ``Task ... ran for 0.144s ... likely a tight sync loop``: the client's I/O thread waited
      for the interpreter while the loop counted a batch; the client copes, and intake shows
      in panagg_lag_records."""
    import ssl

    from kafka.errors import (
        CoordinatorNotAvailableError,
        KafkaConnectionError,
        NodeNotReadyError,
        RequestTimedOutError,
    )

    if record.name.split(".", 1)[0] != "kafka":
        return True
    text = record.getMessage()
    if "likely a tight sync loop" in text:
        return False
    errors = [
        a
        for a in (record.args if isinstance(record.args, tuple) else ())
        if isinstance(a, BaseException)
    ]
    if record.exc_info and record.exc_info[1] is not None:
        errors.append(record.exc_info[1])
    if any(isinstance(e, ssl.SSLError) for e in errors) or "SSL" in text:
        return True  # a TLS problem is not an outage
    if any(
        isinstance(
            e,
            (
                KafkaConnectionError,
                NodeNotReadyError,
                RequestTimedOutError,
                CoordinatorNotAvailableError,
                ConnectionError,
            ),
        )
        for e in errors
    ):
        return False
    return not any(word in text for word in _CONNECTION_WORDS)


def _setup_logging(verbose: bool = False) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    repeated = _RepeatedLibraryLines()
    for handler in logging.getLogger().handlers:
        if _one_line_library_errors not in handler.filters:
            if not verbose:  # (before the repeat counter: a line left out is not "held back")
                handler.addFilter(_handled_library_line)
            handler.addFilter(_one_line_library_errors)
            handler.addFilter(repeated)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    # -v is panagg's own detail, not every library's debug output (fonts, sockets)
    for noisy in ("matplotlib", "PIL", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def probe_bootstrap(bootstrap: str, timeout_s: float = 5.0, say: bool = True) -> str | None:
    """One line saying why no bootstrap server can be reached (None: one answers TCP).

    The Kafka client reports a wrong host name, a closed port and a silent firewall alike, as a
    timeout after the whole connect timeout; a plain resolve-and-connect first tells them apart
    in at most ``timeout_s`` per server. It proves only that something listens: the client still
    does the real handshake (and says so if that fails)."""
    import logging
    import socket

    servers = [s.strip() for s in str(bootstrap).split(",") if s.strip()]
    problems = []
    for server in servers:
        host, _, port = server.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            problems.append(f"{server!r} is not host:port")
            continue
        if say:
            logging.getLogger("panagg.service").info("connecting to Kafka at %s", server)
        try:
            addrs = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror:
            problems.append(f"cannot resolve host {host!r} (DNS)")
            continue
        reason = None
        for family, stype, proto, _, addr in addrs:
            try:
                with socket.socket(family, stype, proto) as sock:
                    sock.settimeout(timeout_s)
                    sock.connect(addr)
                return None
            except ConnectionRefusedError:
                reason = f"connection refused at {server} (nothing listens on that port)"
            except (TimeoutError, socket.timeout):
                reason = (
                    f"no answer from {server} within {timeout_s:g} s (a firewall, or the "
                    "wrong address)"
                )
            except OSError as exc:
                reason = f"cannot connect to {server} ({exc.strerror or type(exc).__name__})"
        problems.append(reason or f"no address for {server}")
    return (
        "cannot reach Kafka: " + "; ".join(problems) + ". Check source.bootstrap and that "
        "the broker is running (deploy/kafka/kafka.sh start)"
    )


def _wait_for_bootstrap(cfg: Config) -> None:
    """The service (one process or a group member) waits for a broker that does not answer
    (yet): up to source.connect_timeout_s, probing every second, with one line when it starts
    waiting; then one line naming the setting. A service restarted while the broker restarts
    thus starts when the broker is back instead of crash-looping (issue 46). A malformed address
    or a host name that does not resolve (a typo, most often) fails at once."""
    wait_s = float(cfg.source.connect_timeout_s)
    deadline = time.monotonic() + wait_s
    problem = probe_bootstrap(cfg.source.bootstrap, min(5.0, wait_s))
    if problem and "is not host:port" not in problem and "cannot resolve host" not in problem:
        logging.getLogger("panagg.service").warning(
            "%s; waiting up to %g s for it (source.connect_timeout_s)",
            problem.split(". ")[0],
            wait_s,
        )
        while problem and time.monotonic() < deadline:
            time.sleep(1.0)
            problem = probe_bootstrap(cfg.source.bootstrap, min(5.0, wait_s), say=False)
        if problem:
            problem = problem.replace(
                ". Check", f" for {wait_s:g} s (source.connect_timeout_s). Check", 1
            )
    if problem:
        raise UsageError(problem)


def _topic_missing(source, topic: str, shuffle: bool = False) -> str | None:
    """One line when the cluster has no topic ``topic`` (None: it exists, or the metadata could
    not be read, in which case the client's own errors follow). The shuffle model's analyzer
    topic has one partition and panagg's own command makes it."""
    try:
        topics = source.topics()
    except Exception:
        return None
    if topic in topics:
        return None
    near = sorted(t for t in topics if not t.startswith("__"))[:8]
    how = (
        "with `panagg shuffle-topics --config FILE` (one partition, with the client topic)"
        if shuffle
        else f"(e.g. kafka-topics.sh --create --topic {topic} --partitions 3)"
    )
    return f"topic {topic!r} does not exist on the cluster: create it {how} or fix source.topic" + (
        f"; topics there: {', '.join(near)}" if near else ""
    )


def _make_source(cfg: Config):
    src = cfg.source
    if src.kind == "kafka":
        import hashlib
        import os

        # static membership: a restarted process (same state dir) takes its partitions back at
        # once instead of waiting for the dead member's session to time out
        instance = (
            src.instance_id
            or "panagg-"
            + hashlib.sha256(os.path.abspath(cfg.checkpoint.dir).encode()).hexdigest()[:16]
        )
        _wait_for_bootstrap(cfg)
        if src.client == "confluent":
            from consumers.kafka.confluent import ConfluentSource

            rd = {
                "session.timeout.ms": int(src.session_timeout_s * 1000),
                "heartbeat.interval.ms": int(min(3.0, src.session_timeout_s / 3) * 1000),
                "group.instance.id": instance,
            }
            if cfg.state.model == "shuffle":
                rd["isolation.level"] = "read_committed"
            source = ConfluentSource(
                src.bootstrap,
                src.topic,
                src.group,
                src.max_records,
                consumer_config=rd,
                security=cfg.security,
                fetch_max_bytes=src.fetch_max_bytes,
                max_partition_fetch_bytes=src.max_partition_fetch_bytes,
            )
            logging.getLogger("panagg.service").info(
                "reading with %s (source.client = confluent)", source.client_version
            )
        else:
            from consumers.kafka.kafka_python import KafkaSource

            consumer_config = {
                "bootstrap_timeout_ms": int(src.connect_timeout_s * 1000),
                "session_timeout_ms": int(src.session_timeout_s * 1000),
                "heartbeat_interval_ms": int(min(3.0, src.session_timeout_s / 3) * 1000),
                "fetch_max_bytes": src.fetch_max_bytes,
                "max_partition_fetch_bytes": src.max_partition_fetch_bytes,
                "group_instance_id": instance,
                # reading must never create the topic it reads (a typo would wait on nothing)
                "allow_auto_create_topics": False,
            }
            if cfg.state.model == "shuffle":  # the shuffler's windows are transactions
                consumer_config["isolation_level"] = "read_committed"
            source = KafkaSource(
                src.bootstrap,
                src.topic,
                src.group,
                src.max_records,
                consumer_config=consumer_config,
                security=cfg.security,
            )
        missing = _topic_missing(source, src.topic, shuffle=cfg.state.model == "shuffle")
        if missing:
            source.close()
            raise UsageError(missing)
        return source
    if src.kind == "file":
        from consumers.file_source import FileSource

        return FileSource(
            src.path, fmt="json" if src.format == "json" else "msgpack", batch=src.max_records
        )
    from consumers.generator import GeneratorSource, ZipfLogins

    gen = ZipfLogins(
        events=src.generator_events,
        accounts=cfg.state.domain_size,
        s=src.generator_zipf,
        batch=src.max_records,
        seed=None if src.generator_seed < 0 else src.generator_seed,
    )
    return GeneratorSource(gen, rate=src.generator_rate or None)


class _StoppedBeforeStart(Exception):
    """SIGTERM or SIGINT while the service was still being built (e.g. waiting for Kafka)."""


def _run_service(cfg: Config, idle_exit_s: float | None = None, **start) -> int:
    import signal

    from .metrics import Metrics

    metrics = Metrics()
    from .config import rollup_split_line

    split = rollup_split_line(cfg)
    if split:
        logging.getLogger("panagg.service").info(split)

    def stop_before_start(*_):  # nothing is written yet: a SIGTERM here just ends the start
        raise _StoppedBeforeStart()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_before_start)
    try:
        agg = _make_aggregator(cfg, metrics, **start)
    except _StoppedBeforeStart:
        logging.getLogger("panagg.service").info(
            "stopped before the start completed (nothing was counted or written)"
        )
        return 0
    if cfg.metrics.port >= 0:
        try:
            port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {cfg.metrics.host}:"
                f"{cfg.metrics.port} ({exc.strerror}); set metrics.port "
                "(0 = any free port, -1 = off)"
            ) from None
        url = f"http://{cfg.metrics.host}:{port}/metrics"
        print(f"metrics on {url}", file=sys.stderr)
        # for panagg status, once the start succeeded (a refused start writes nothing)
        agg.on_started = lambda: _note_metrics_url(cfg, url)
        if hasattr(agg, "metrics_url"):  # a group member reports it in the group's topic
            agg.metrics_url = url
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agg.stop_event.set())
    try:
        agg.run(idle_exit_s=idle_exit_s)
    finally:
        metrics.close()
    return 0


def _note_metrics_url(cfg: Config, url: str) -> None:
    """Leave the metrics URL in the state directory for ``panagg status`` (port 0 picks one)."""
    from pathlib import Path

    from .status import METRICS_URL_FILE

    d = Path(cfg.checkpoint.dir)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / METRICS_URL_FILE, url + "\n", mode=None)


def _make_aggregator(cfg: Config, metrics=None, **start):
    """The service object for ``cfg`` with its source (one line if Kafka is unreachable)."""
    import logging

    from .process import Aggregator

    if cfg.state.model == "shuffle":  # the analyzer's key first: one line if missing
        from .analyzer import load_analyzer_key

        start["private_key"] = load_analyzer_key(cfg)
    if cfg.scale.partitioned:
        from .group.service import GroupService  # builds its own Kafka clients

        _wait_for_bootstrap(cfg)
        return GroupService(cfg, metrics, **start)
    kafka_net = logging.getLogger("kafka.net")
    quiet = kafka_net.level < logging.CRITICAL and not logging.getLogger().isEnabledFor(
        logging.DEBUG
    )
    if quiet:  # bootstrap retries log a burst of errors; one line of ours says it all
        kafka_net.setLevel(logging.CRITICAL)
    try:
        source = _make_source(cfg)
    except Exception as exc:
        from consumers.kafka_security import KafkaConnectError

        if isinstance(exc, KafkaConnectError):  # a secured cluster said why: one line, the fix
            raise UsageError(str(exc)) from None
        if type(exc).__module__.startswith("kafka"):
            raise UsageError(
                f"cannot reach Kafka at {cfg.source.bootstrap} "
                f"({type(exc).__name__}); check source.bootstrap and that the broker "
                "is running (deploy/kafka/kafka.sh start)"
            ) from None
        raise
    finally:
        if quiet:
            kafka_net.setLevel(logging.WARNING)
    if cfg.state.model == "shuffle":
        from .analyzer import ShuffleAnalyzer

        return ShuffleAnalyzer(cfg, source, metrics, **start)
    if cfg.aggregations:  # several aggregations of the stream, one consumer
        from .multi import MultiAggregator

        return MultiAggregator(cfg, source, metrics, **start)
    return Aggregator(cfg, source, metrics, **start)


def _load(args: argparse.Namespace, extra: list[str], state_dir: str | None = None) -> dict:
    """Config from --config / env / --set; with ``state_dir``, the service's saved config first."""
    from pathlib import Path

    from .config import ConfigError, load_config

    sets = list(getattr(args, "set", None) or []) + extra
    base = None
    if state_dir and not getattr(args, "config", None):
        saved = Path(state_dir) / "config.json"
        if saved.exists():
            base = json.loads(saved.read_text())
    try:
        return load_config(getattr(args, "config", None), sets, base=base)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def cmd_run(args: argparse.Namespace) -> int:
    extra = []
    for flag, key in (
        ("bootstrap", "source.bootstrap"),
        ("topic", "source.topic"),
        ("epsilon", "state.epsilon"),
        ("state_dir", "checkpoint.dir"),
        ("release_dir", "release.dir"),
        ("metrics_port", "metrics.port"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            extra.append(f"{key}={value}")
    cfg = _load(args, extra)
    _setup_logging(args.verbose)
    from state_store.audit import AuditKeyError, check_configured_key

    try:  # a mistyped key stops the start, not the first export (nothing is written yet)
        check_configured_key(cfg.audit.key_file or None)
    except AuditKeyError as exc:
        raise UsageError(str(exc)) from None
    start = {}
    if args.same_records_as:
        if not args.accept_change:
            raise UsageError(
                "--same-records-as goes with --accept-change (it says what the "
                "change of source.topic is)"
            )
        if cfg.scale.partitioned or cfg.state.model == "shuffle":
            raise UsageError(
                "--same-records-as applies to a one-process service (not to "
                "scale.store = kafka nor to the shuffle analyzer)"
            )
        start["same_records_as"] = args.same_records_as
    return _run_service(
        cfg,
        idle_exit_s=args.exit_when_idle,
        fresh_start=args.fresh_start,
        accept_change=args.accept_change,
        **start,
    )


def cmd_shuffle_keygen(args: argparse.Namespace) -> int:
    """A new analyzer key pair: the private key to --out (0600, never overwritten), the public
    key (hex) on stdout for the clients (docs/shuffle.md, "The analyzer")."""
    from .shuffle_wire import new_keypair, public_key_hex, save_private_key

    where = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(where):
        raise UsageError(
            f"the directory {where} for --out does not exist: create it first "
            "(readable by the analyzer's user only), then run shuffle-keygen again"
        )
    key = new_keypair()
    try:
        save_private_key(key, args.out)
    except FileExistsError:
        raise UsageError(
            f"{args.out} exists; a key file is never overwritten (the analyzer "
            "could no longer open what clients sealed to the old key): choose "
            "another --out"
        ) from None
    print(public_key_hex(key))
    return 0


def cmd_shuffle(args: argparse.Namespace) -> int:
    """The shuffle model's shuffler (docs/shuffle.md, "The shuffler")."""
    import signal
    import threading

    from .shuffler import Shuffler, ShufflerError

    def stop_before_start(*_):  # nothing is written before the loop: the start just ends
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_before_start)
    extra = [f"metrics.port={args.metrics_port}"] if args.metrics_port is not None else []
    cfg = _load(args, extra)
    _setup_logging(args.verbose)
    try:
        shuffler = Shuffler(cfg)
    except ShufflerError as exc:
        raise UsageError(str(exc)) from None
    # as `panagg run`: a broker that does not answer (yet) is waited for up to
    # source.connect_timeout_s (a shuffler restarted while the broker restarts starts when it is
    # back instead of crash-looping), then one line naming the setting, not the client's retries
    _wait_for_bootstrap(cfg)
    if cfg.metrics.port >= 0:
        try:
            port = shuffler.metrics.serve(cfg.metrics.host, cfg.metrics.port)
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {cfg.metrics.host}:"
                f"{cfg.metrics.port} ({exc.strerror}); set metrics.port "
                "(--metrics-port; -1 turns metrics off)"
            ) from None
        # the same start line as `panagg run`'s, which scripts and supervisors read
        print(f"metrics on http://{cfg.metrics.host}:{port}/metrics", file=sys.stderr)
    # SIGTERM (a supervisor's stop) and SIGINT end the loop between polls: the committed windows
    # stay, the open one is read again at the next start (as at --exit-when-idle), exit status 0
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        shuffler.run(idle_exit_s=args.exit_when_idle, stop=stopping.is_set)
    except ShufflerError as exc:
        raise UsageError(str(exc)) from None
    if stopping.is_set():
        logging.getLogger("panagg.shuffle").info(
            "stopped on a signal; the open window's records are read again at the next start"
        )
    st = shuffler.stats
    print(
        f"{st['windows']} window(s), {st['events']} events, {st['messages']} messages, "
        f"{st['topped_up']} topped up, {st['duplicates']} duplicates dropped, "
        f"{st['dead_letters']} dead letters"
    )
    return 0


def cmd_shuffle_clients(args: argparse.Namespace) -> int:
    """Play many shuffle-model clients: --events events, items Zipf(1.1) over the domain."""
    import numpy as np
    from kafka import KafkaProducer

    from consumers.kafka_security import client_options

    from .shuffle_client import ShuffleClient
    from .shuffler import ShufflerError

    cfg = _load(args, [])
    _setup_logging(args.verbose)
    topic = cfg.shuffle.client_topic
    if not topic:
        raise UsageError("panagg shuffle-clients needs shuffle.client_topic")
    try:
        client = ShuffleClient.from_config(cfg)
    except ShufflerError as exc:
        raise UsageError(str(exc)) from None
    D = client.randomizer.buckets if cfg.state.mode == "direct" else 10 * client.randomizer.buckets
    w = 1.0 / np.arange(1, D + 1) ** 1.1
    rng = np.random.default_rng()
    hashed = cfg.state.mode != "direct"  # hashed mode: text items "item-<k>"
    producer = KafkaProducer(
        bootstrap_servers=cfg.source.bootstrap,
        acks="all",
        max_request_size=16 * 1024 * 1024,
        **client_options(cfg.security),
    )
    sent = 0
    while sent < args.events:
        k = min(1000, args.events - sent)
        ids = rng.choice(D, size=k, p=w / w.sum())
        for key, value in client.records([f"item-{i}" for i in ids] if hashed else ids):
            producer.send(topic, key=key, value=value)
        sent += k
    producer.flush()
    producer.close()
    print(f"{sent} events sent to {topic}")
    return 0


def cmd_shuffle_topics(args: argparse.Namespace) -> int:
    """Create the shuffle model's topics with kafka-python's admin client (docs/shuffle.md)."""
    from .topics import TopicError, create_topics, shuffle_topics

    extra = [f"source.bootstrap={args.bootstrap}"] if args.bootstrap else []
    cfg = _load(args, extra)
    try:
        done = create_topics(
            cfg,
            shuffle_topics(cfg, args.client_partitions),
            replication_factor=args.replication_factor,
        )
    except TopicError as exc:
        raise UsageError(str(exc)) from None
    for topic, parts, what in done:
        print(f"{topic}: {parts} partition(s), {what}")
    return 0


def cmd_shuffle_recover(args: argparse.Namespace) -> int:
    """Release refused shuffle windows once their cause is fixed (docs/shuffle.md,
    "Recovering a refused window"): this config must hold the fix (the clients' key or
    parameters); the analyzer of --state-dir must be stopped."""
    from .analyzer import ShuffleAnalyzer, load_analyzer_key
    from .errors import ServiceError

    extra = [f"checkpoint.dir={args.state_dir}"] if args.state_dir else []
    if args.bootstrap:
        extra.append(f"source.bootstrap={args.bootstrap}")
    cfg = _load(args, extra)
    _setup_logging(args.verbose)
    if cfg.state.model != "shuffle":
        raise UsageError("panagg shuffle-recover is for state.model = shuffle")
    try:
        analyzer = ShuffleAnalyzer(cfg, None, private_key=load_analyzer_key(cfg))
        results = analyzer.recover(args.window or None)
    except ServiceError as exc:
        raise UsageError(str(exc)) from None
    for window, uid, outcome in results:
        print(f"window {window}{f' ({uid})' if uid else ''}: {outcome}")
    return 0 if results and all(o in ("released", "re-published") for _, _, o in results) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """``panagg demo``: synthetic logins through the service's pipeline, then each release beside
    the truth of its window (the generator's data is known here: recomputed from its seed)."""
    import tempfile

    windows = args.windows
    per_window = args.events // windows
    if per_window < 1:
        raise UsageError(
            f"--events {args.events} is fewer than --windows {windows}; "
            "give at least one event per window"
        )
    from pathlib import Path

    output = Path(args.output)
    if list(output.glob("release-*.json")):  # an earlier run's releases: never overwrite them
        output = output / time.strftime("run-%Y%m%dT%H%M%SZ", time.gmtime())
    # the synthetic data's seed (not privacy noise): the truth below is regenerated from it
    seed = args.seed if args.seed is not None else secrets.randbelow(2**63)
    print(
        f"panagg demo: {args.events:,} synthetic logins over {args.accounts:,} accounts "
        f"(Zipf {args.zipf}, data seed {seed}), eps={args.epsilon}, model={args.model}, "
        f"{windows} window(s)"
    )
    with tempfile.TemporaryDirectory(prefix="panagg-demo-") as state_dir:
        cfg = _load(
            args,
            [
                "source.kind=generator",
                f"source.generator_events={per_window * windows}",
                f"source.generator_zipf={args.zipf}",
                f"source.generator_seed={seed}",
                f"state.domain_size={args.accounts}",
                f"state.epsilon={args.epsilon}",
                f"state.model={args.model}",
                "window.kind=count",
                f"window.size={per_window}",
                f"checkpoint.dir={state_dir}",
                f"release.dir={output}",
                "metrics.port=-1",
            ],
        )
        _setup_logging()
        _run_service(cfg)
    releases = sorted(
        ((json.loads(path.read_text()), path) for path in output.glob("release-*.json")),
        key=lambda r: r[0]["window"],
    )
    truth = demo_truth(cfg, [rel["window_info"]["events"] for rel, _ in releases])
    for (rel, path), (true_distinct, true_entropy) in zip(releases, truth):
        print(demo_line(rel, true_distinct, true_entropy, path))
    return 0


def demo_truth(cfg: Config, events: list[int]) -> list[tuple[int, float]]:
    """(distinct items, plug-in entropy in nats) of each window of the demo's generator, in
    order: windows of ``events[k]`` events each, one after the other from the first event (the
    generator source's offsets, as the count windows cut them), regenerated from the seed."""
    from consumers.generator import ZipfLogins

    from ..properties import entropy

    src = cfg.source
    gen = ZipfLogins(
        events=src.generator_events,
        accounts=cfg.state.domain_size,
        s=src.generator_zipf,
        batch=src.max_records,
        seed=src.generator_seed,
    )
    ids = np.concatenate(list(gen.iter_batches())) if src.generator_events else np.zeros(0, int)
    out, start = [], 0
    for k in events:
        counts = np.bincount(ids[start : start + k], minlength=1)
        counts = np.sort(counts[counts > 0])[::-1]
        out.append((int(len(counts)), float(entropy(counts))))
        start += k
    return out


def demo_line(rel: dict, true_distinct: int, true_entropy: float, path) -> str:
    """One window of ``panagg demo``: the released headline figures with their intervals, each
    beside its truth, e.g. "distinct items 63,080 (59,721-67,156); true 61,912"."""
    head = rel["headline"]

    def one(key: str, fmt: str, unit: str = "") -> str:
        s = head[key]
        iv = (
            f" ({format(s['interval'][0], fmt)}-{format(s['interval'][1], fmt)})"
            if s["interval"]
            else ""
        )
        return f"{format(s['value'], fmt)}{unit}{iv}"

    level = head.get("interval_level")
    lvl = f", {level:.0%} intervals" if level else ""
    flag = "; BELOW THE NOISE" if head.get("signal_below_noise") else ""
    return (
        f"window {rel['window']} (n={rel['n']:,}{lvl}): distinct items "
        f"{one('distinct_items', ',.0f')}; true {true_distinct:,}. entropy "
        f"{one('entropy_nats', '.3f', ' nats')}; true {true_entropy:.3f}{flag} -> {path}"
    )


def _control(cfg: Config, kind: str, timeout_s: float = 120.0) -> dict:
    """Ask the running service to act (between batches) and wait for its answer; a service that
    stops before it answers (its finite source ran out, a SIGTERM) is seen at once, not after
    ``timeout_s``."""
    import uuid
    from pathlib import Path

    from .stages.state_dir import service_running

    where = cfg.checkpoint.dir
    control = Path(where) / "control"
    control.mkdir(parents=True, exist_ok=True)
    rid = uuid.uuid4().hex[:12]
    req = control / f"{kind}-{rid}.req"
    req.write_text("")
    done = req.with_suffix(".done")
    deadline = time.monotonic() + timeout_s
    checked = time.monotonic()
    while time.monotonic() < deadline:
        if done.exists():
            result = json.loads(done.read_text())
            done.unlink(missing_ok=True)
            return result
        if time.monotonic() - checked >= 0.5:
            checked = time.monotonic()
            if not service_running(where) and not done.exists():
                req.unlink(missing_ok=True)  # nobody will answer it
                raise UsageError(
                    f"the service on {where} stopped before it answered the {kind} "
                    "request; run the command again (with no service running it "
                    "runs here, from the checkpoint)"
                )
        time.sleep(0.1)
    req.unlink(missing_ok=True)
    raise UsageError(
        f"the running service did not answer the {kind} request within "
        f"{timeout_s:.0f} s; is it stuck? see its log"
    )


def _offline(cfg: Config):
    """The service over its checkpoint and source while it is not running: the open window's
    counters exist only in a running service's memory, so they are rebuilt by replaying the
    window from the source up to its current end (docs/privacy.md)."""
    from pathlib import Path

    if (Path(cfg.checkpoint.dir) / "aggregations.json").exists():
        raise UsageError(
            f"{cfg.checkpoint.dir} holds several aggregations; pass "
            f"--state-dir {cfg.checkpoint.dir}/NAME for one of them"
        )
    if not (Path(cfg.checkpoint.dir) / "checkpoints").is_dir():
        raise UsageError(
            f"{cfg.checkpoint.dir} holds no panagg state (no checkpoints/ "
            "directory); pass the --state-dir the service runs with"
        )
    agg = _make_aggregator(cfg)
    agg._lock()
    try:
        agg.restore()
        agg.catch_up()
    except BaseException:
        agg.close()
        raise
    return agg


def cmd_release(args: argparse.Namespace) -> int:
    from .stages.state_dir import service_running

    cfg = _load(
        args,
        [f"checkpoint.dir={args.state_dir}"] if args.state_dir else [],
        state_dir=args.state_dir,
    )
    if cfg.scale.partitioned:
        return _group_release(cfg, args.state_dir)
    if cfg.state.model == "shuffle":
        raise UsageError(
            "state.model = shuffle: a window is released at the shuffler's end "
            "marker, never before (its noise is complete only then); there is no "
            "forced release (docs/shuffle.md)"
        )
    if service_running(cfg.checkpoint.dir):
        result = _control(cfg, "release")
        if not result.get("ok"):
            raise UsageError(result.get("error", "release failed"))
        print(f"released window {result['window']} (by the running service)")
        return 0
    agg = _offline(cfg)
    try:
        rel = agg.close_window()
    finally:
        agg.close()
    if rel is None:
        raise UsageError(
            "the privacy ledger refused the release (budget spent); see "
            "`ledger.budget_total` in docs/configuration.md"
        )
    print(f"released window {rel['window']} (n={rel['n']:,}) to {cfg.release.dir}")
    return 0


def _group_aggregations(cfg: Config, state_dir: str | None) -> list[tuple[str, dict]]:
    """(name, config) of each aggregation of a group member: from the config, or from the
    member directory's saved config (a saved config's ``[aggregations]`` are not read back into
    ``cfg``); ("", cfg) for a group of one."""
    import os
    from pathlib import Path

    from .config import aggregation_configs

    named = aggregation_configs(cfg)
    if named:
        return named
    saved = Path(state_dir) / "config.json" if state_dir else None
    names = sorted(
        (json.loads(saved.read_text()).get("aggregations") or {})
        if saved is not None and saved.exists()
        else []
    )
    if not names:
        return [("", cfg)]
    return [
        (name, cfg.updated({"checkpoint": {"dir": os.path.join(cfg.checkpoint.dir, name)}}))
        for name in names
    ]


def _ask_group(cfg: Config, request, state_dir: str | None = None):
    """``request(bootstrap, security, topics)`` of each aggregation's leader of a Kafka-only
    group (aggregator/service/group/forced.py); yields (name, config, answer)."""
    from consumers.kafka_security import client_options

    from .group.forced import ForcedReleaseError
    from .group.topics import GroupTopics

    src = cfg.source
    for name, one in _group_aggregations(cfg, state_dir):
        try:
            got = request(src.bootstrap, client_options(cfg.security), GroupTopics(src.group, name))
        except ForcedReleaseError as exc:
            raise UsageError(str(exc)) from None
        yield name, one, got


def _group_release(cfg: Config, state_dir: str | None = None) -> int:
    """A forced release of a Kafka-only group, asked of each aggregation's leader."""
    from .group.forced import request_release

    src = cfg.source
    for name, _, got in _ask_group(cfg, request_release, state_dir):
        what = f"{name} window" if name else "window"
        if got["release"] is None:
            print(
                f"{what} {got['window']} closed in every partition; its release follows once "
                f"every summary is in (panagg status --group {src.group} --bootstrap "
                f"{src.bootstrap})"
            )
        else:
            print(f"released {what} {got['window']} (by the group's leader)")
    return 0


def _group_export(cfg: Config, state_dir: str | None = None) -> int:
    """An audit export of a Kafka-only group, signed by each aggregation's leader
    (aggregator/service/group/export.py); the document is written here too."""
    from pathlib import Path

    from state_store.audit import save_export

    from .group.forced import request_export

    for _, one, got in _ask_group(cfg, request_export, state_dir):
        out = Path(one.audit.dir or Path(one.checkpoint.dir) / "exports")
        print(save_export(out / f"export-{got['id']}.panagg", got["document"]))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from state_store.audit import AuditKeyError, ExportError, load_key, read_export

    from ..state import PanPrivateHistogram

    if args.audit_command == "export":
        from .stages.state_dir import service_running

        cfg = _load(
            args,
            [f"checkpoint.dir={args.state_dir}"] if args.state_dir else [],
            state_dir=args.state_dir,
        )
        # a running service signs with its own key (its environment, its audit.key_file): this
        # shell's key is only checked when the export runs here, offline
        if cfg.scale.partitioned:
            return _group_export(cfg, args.state_dir)
        if cfg.state.privacy_unit == "user":  # before anything is replayed or ledgered
            from .user_window import NO_EXPORT

            raise UsageError(NO_EXPORT)
        if service_running(cfg.checkpoint.dir):
            result = _control(cfg, "export")
            if not result.get("ok"):
                raise UsageError(result.get("error", "export failed"))
            print(result["path"])
            _note_other_key(cfg, result["path"])
            return 0
        try:
            load_key(cfg.audit.key_file or None)  # fail before touching the state
        except AuditKeyError as exc:
            raise UsageError(
                f"{exc} (no service is running on {cfg.checkpoint.dir}: the "
                "export runs here, with this shell's key)"
            ) from None
        agg = _offline(cfg)
        try:
            print(agg.export())
        finally:
            agg.close()
        return 0
    try:
        key = load_key(args.key_file) if args.audit_command == "verify" else None
        doc = read_export(args.file, key)
    except (AuditKeyError, ExportError) as exc:
        raise UsageError(str(exc)) from None
    state = PanPrivateHistogram.deserialize(doc["state"])
    if args.audit_command == "verify":
        print(f"OK: {args.file} verifies (key id {doc['key_id']}), export {doc['export_id']}")
        return 0
    counts = state.counts
    summary = {
        "export_id": doc["export_id"],
        "created_unix": doc["created_unix"],
        "signature_checked": False,
        "key_id": doc["key_id"],
        "window": doc["window"],
        "offsets": doc["offsets"],
        "mode": state.mode,
        "size": state.size,
        "n": state.n,
        "epsilon": state.epsilon,
        "neighbor": state.neighbor,
        "p": state.p,
        "layers": state.layers,
        "counter_summary": {
            "min": int(counts.min()),
            "max": int(counts.max()),
            "mean": float(counts.mean()),
        },
    }
    print(json.dumps(summary, indent=1))
    if args.counters:
        np.save(args.counters, counts)
        print(f"counters written to {args.counters}", file=sys.stderr)
    return 0


def _note_other_key(cfg: Config, path: str) -> None:
    """A key in this shell does not sign a running service's export (the service signs with its
    own): say so when they differ, or `audit verify` with this shell's key fails later."""
    from state_store.audit import AuditKeyError, key_id, load_key, read_export

    try:
        mine = key_id(load_key(cfg.audit.key_file or None))
        theirs = read_export(path)["key_id"]
    except (AuditKeyError, ValueError, OSError):
        return  # no key here: nothing to mix up
    if mine != theirs:
        print(
            f"panagg: note: the running service signed this export with its own key (key id "
            f"{theirs}), not this shell's (key id {mine}); verify it with the service's key",
            file=sys.stderr,
        )


FORMS = ("counts", "per-item", "prevalences")
# header names that say what a two-column CSV holds (lower-cased, stripped)
_PREVALENCE_HEADERS = {
    ("r", "phi_r"),
    ("r", "phi"),
    ("count", "items"),
    ("count", "num_items"),
    ("frequency", "items"),
    ("times_seen", "items"),
}
_COUNT_NAMES = {"count", "counts", "n", "events", "frequency", "times_seen"}


def read_histogram_file(path: str, form: str | None = None):
    """("counts", int array) or ("prevalences", [(r, phi_r), ...]) from a CSV or JSON file.

    JSON: a list of counts, {"counts": [...]}, {"prevalences": [[r, phi_r], ...]}, or a panagg
    release ({"histogram": {"pairs": ...}}). CSV: one column of counts (one line per item), or two
    columns that are either (item, count) per item (``form="per-item"``) or (r, phi_r)
    (``form="prevalences"``). Two columns are ambiguous (a headed ``account,count`` file read as
    (r, phi_r) once released 58.7M events for 40k), so their form comes from ``form`` or from a
    header that names it (``item,count``; ``r,phi_r``), and is refused otherwise.
    """
    import csv
    import json
    from pathlib import Path

    import numpy as np

    if form is not None and form not in FORMS:
        raise UsageError(f"--form must be one of {', '.join(FORMS)}, got {form!r}")
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
            raise UsageError(
                f'{path}: expected a list of counts, {{"counts": [...]}} or '
                '{"prevalences": [[r, phi_r], ...]}'
            )
        kind = "counts" if "counts" in doc else "prevalences"
        if form is not None and form != kind:  # JSON names its form; per-item is a CSV form
            raise UsageError(
                f"{path}: the JSON holds {kind}, not {form}; drop --form or fix the file"
            )
        rows = doc[kind]
    else:
        rows = [row for row in csv.reader(text.splitlines()) if row and any(c.strip() for c in row)]
        header = None
        if rows and not all(_is_int(c) for c in rows[0]):
            header = tuple(c.strip().lower() for c in rows[0])
            rows = rows[1:]
        widths = {len(r) for r in rows}
        if widths - {1, 2} or len(widths) > 1:
            raise UsageError(
                f"{path}: CSV must have one column (counts) or two (item, count or "
                "r, phi_r) on every line"
            )
        if widths == {2}:
            if form is None and header is not None:
                if header in _PREVALENCE_HEADERS:
                    form = "prevalences"
                elif header[1] in _COUNT_NAMES:
                    form = "per-item"
            if form is None:
                named = f"header {','.join(header)!r}" if header else "no header"
                raise UsageError(
                    f"{path}: two columns and {named}: say what they are with --form per-item "
                    "(item, count: one line per item) or --form prevalences (r, phi_r: how many "
                    "items were seen r times)"
                )
            if form == "counts":
                raise UsageError(
                    f"{path}: --form counts needs one column; two columns are "
                    "--form per-item or --form prevalences"
                )
            if form == "per-item":
                kind, rows = "counts", [r[1] for r in rows]
            else:
                kind = "prevalences"
                rs = [r[0].strip() for r in rows]
                if len(set(rs)) != len(rs):
                    raise UsageError(
                        f"{path}: --form prevalences needs each r once, and some r "
                        "repeats: is it an (item, count) file? use --form per-item"
                    )
        else:
            if form not in (None, "counts"):
                raise UsageError(
                    f"{path}: one column is --form counts (one count per item), not {form}"
                )
            kind, rows = "counts", [r[0] for r in rows]
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
    from .. import central
    from ..release import package_release, write_release

    kind, arr = read_histogram_file(args.input, args.form)
    algorithm = args.algorithm
    if algorithm == "auto":
        algorithm = "dpanonhist" if args.epsilon >= 1 else "privhist"
    if algorithm == "dpanonhist" and args.epsilon < 1:
        raise UsageError("dpanonhist needs --epsilon >= 1; use --algorithm privhist below 1")
    if algorithm == "dpanonhist":
        counts = arr if kind == "counts" else np.repeat(arr[:, 0], arr[:, 1])
        hist = central.dp_anon_hist(counts, args.epsilon, n=args.public_n)
    else:
        hist = (
            central.privhist(arr, args.epsilon)
            if kind == "counts"
            else central.privhist(prevalences=arr.tolist(), epsilon=args.epsilon)
        )
    release = package_release(
        hist,
        window=args.name,
        n=None,
        epsilon=args.epsilon,
        neighbor="anonymized histograms at l1 distance 1 (one item's count +-1)",
        model="central",
        extra={
            "algorithm": algorithm,
            "public_n": args.public_n if algorithm == "dpanonhist" else None,
        },
    )
    # no release_seconds here: the time to run the mechanism on the raw counts depends on them
    path = write_release(release, args.output)
    print(
        f"central {algorithm} eps={args.epsilon}: released {len(hist):,} items, "
        f"n_hat={int(hist.sum()):,} -> {path}"
    )
    return 0


def _version() -> str:
    from .metrics import panagg_version

    return panagg_version()


def cmd_ledger(args: argparse.Namespace) -> int:
    """``panagg ledger show``: what was released, refused, exported and restarted, and the
    epsilon spent and left."""
    from pathlib import Path

    from .ledger import Ledger, LedgerError, migrate
    from .stages.state_dir import service_running

    path = Path(args.state_dir) / "ledger.jsonl"
    if not path.exists():
        raise UsageError(
            f"{args.state_dir} holds no ledger (no ledger.jsonl); pass the "
            "--state-dir the service runs with"
        )
    if args.ledger_command == "migrate":
        if service_running(args.state_dir):
            raise UsageError(f"a panagg service is running on {args.state_dir}; stop it first")
        try:
            n = migrate(path)
        except LedgerError as exc:
            raise UsageError(str(exc)) from None
        print(
            f"ledger {path}: {n} entries migrated to format 2 (hash chain, source ranges "
            f"from each release's end offsets); the original is {path}.v1"
        )
        return 0
    try:
        ledger = Ledger(path, budget_per_window=1.0)
    except LedgerError as exc:
        raise UsageError(str(exc)) from None
    identity = ledger.identity() or {}
    if args.json:
        print(
            json.dumps(
                {
                    "identity": identity,
                    "entries": [
                        {k: v for k, v in e.items() if k != "document"} for e in ledger.entries
                    ],
                },
                indent=1,
            )
        )
        return 0
    print(
        f"ledger {path}: {len(ledger.entries)} entries; epsilon spent "
        f"{ledger.spent():g}"
        + (
            f" of budget_total {identity['budget_total']:g}"
            if identity.get("budget_total")
            else " (no total cap)"
        )
    )
    for e in ledger.entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["time_unix"]))
        extra = ""
        if e["kind"] == "release" and e.get("document"):
            doc = json.loads(e["document"])
            props = doc.get("properties", {})
            extra = (
                f"n={doc.get('n')} distinct={props.get('distinct_items')} "
                f"entropy={props.get('entropy_nats', float('nan')):.3f}"
            )
        elif e.get("note"):
            extra = e["note"]
        if e.get("parallel"):  # a breakdown's key: its group's members share one charge
            extra += f"  parallel {e['parallel']['group']} key {e['parallel']['member']}"
        if e.get("ranges"):
            extra += "  positions " + ", ".join(
                f"{p} [{a}, {b})" for p, (a, b) in sorted(e["ranges"].items())
            )
        window = "" if e.get("window") is None else f"window {e['window']}"
        print(f"{when}Z  {e['kind']:<16} {window:<12} eps {e['epsilon_spent']:<5g} {extra}")
    head = ledger.head()
    print(f"head: entry {head['seq']}, sha256 {head['hash'][:24]} (the hash chain verifies)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``panagg plan``: the accuracy plan of a configuration, before any data (public inputs)."""
    from .accuracy_plan import accuracy_plan

    from .config import aggregation_configs

    cfg = _load(args, [])
    several = aggregation_configs(cfg)  # [aggregations.NAME]: one plan each
    if not several:
        line, below = accuracy_plan(cfg)
        print(line)
        return 1 if below else 0
    any_below = False
    for name, one in several:
        line, below = accuracy_plan(one)
        print(f"[{name}] {line}")
        any_below = any_below or below
    spend = several[0][1]["aggregation"]["epsilon_per_event"]
    if cfg.breakdown.field:
        print(
            f"breakdown by {cfg.breakdown.field} over {len(several)} keys, one parallel "
            f"composition: each event spends {spend:g} eps (its key's window) over all of them "
            f"(ledger.budget_per_event {cfg.ledger.budget_per_event:g})"
        )
    else:
        print(
            f"each event spends up to {spend:g} eps over "
            f"{', '.join(name for name, _ in several)} (ledger.budget_per_event "
            f"{cfg.ledger.budget_per_event:g})"
        )
    from .config import rollup_split_line

    split = rollup_split_line(cfg)  # (what a user-level span costs: the start says it too)
    if split and cfg.state.privacy_unit == "user":
        print(split)
    return 1 if any_below else 0


def cmd_estimators(args: argparse.Namespace) -> int:
    """``panagg estimators``: the names ``release.estimator`` takes, from the estimators'
    registry (:data:`aggregator.estimators.ESTIMATORS`), with what each one needs."""
    from ..estimators import ESTIMATORS

    width = max(len(name) for name in ("default", *ESTIMATORS))
    print(
        f"{'default':<{width}}  the accuracy grid's choice per mode and layer count "
        "(docs/accuracy_grid.md)"
    )
    for name, e in ESTIMATORS.items():
        needs = ", ".join(x for x, on in (("uses n", e.uses_n), ("hashed", e.hashed)) if on)
        print(f"{name:<{width}}  {e.doc} [{needs}]")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``panagg status``: exit 0, or 1 when a running service reports itself unhealthy."""
    from .status import StatusError, collect_status, format_status

    if args.group:
        return _group_status(args)
    if not args.state_dir:
        raise UsageError(
            "give --state-dir (one process) or --group with --bootstrap (a group "
            "with scale.store = kafka)"
        )
    saved = _load(args, [], state_dir=args.state_dir)
    if saved.scale.partitioned:
        raise UsageError(
            f"{args.state_dir} is the scratch directory of a member of group "
            f"{saved.source.group!r}, whose state is in Kafka: run panagg "
            f"status --group {saved.source.group} --bootstrap "
            f"{saved.source.bootstrap}"
        )
    try:
        status = collect_status(args.state_dir)
    except StatusError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(status, indent=1, default=str))
    else:
        print("\n".join(format_status(status)))
    health = status.get("health") or {}
    return 1 if any(v.get("code") not in (200, None) for v in health.values()) else 0


def _group_started(s: dict) -> bool:
    """The group has written its identity and its members hold every source partition."""
    held = {p for m in s["members"] for p in m["partitions"]}
    return (
        s.get("identity", {}).get("mode") is not None
        and bool(s["members"])
        and all(row["partition"] in held for row in s.get("partitions", []))
    )


def _group_status(args: argparse.Namespace) -> int:
    """``panagg status --group G --bootstrap B``: a Kafka-only group, read from Kafka."""
    from .group.status import collect_group_status, format_group_status, group_aggregations

    cfg = _load(args, [])
    boot = args.bootstrap or cfg.source.bootstrap
    problem = probe_bootstrap(boot, 5.0)
    if problem:
        raise UsageError(problem)
    from kafka.admin import KafkaAdminClient

    from consumers.kafka_security import client_options

    # --wait: members started a moment ago (the README's group loop) may not have made the
    # group's topics, nor written its identity, yet
    deadline = time.monotonic() + (args.wait or 0.0)
    while True:
        admin = KafkaAdminClient(bootstrap_servers=boot, **client_options(cfg.security))
        try:
            names = group_aggregations(admin.list_topics(), args.group)
        finally:
            admin.close()
        out = []
        for name in names:
            try:
                out.append(
                    collect_group_status(
                        boot,
                        args.group,
                        cfg.security,
                        source_topic=args.topic or cfg.source.topic,
                        aggregation=name,
                    )
                )
            except LookupError as exc:
                if time.monotonic() >= deadline:
                    raise UsageError(str(exc)) from None
        started = names and len(out) == len(names) and all(_group_started(s) for s in out)
        if started or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if not names:
        raise UsageError(
            f"no Kafka-only group {args.group!r} on {boot} (no "
            f"{args.group}.panagg.*ledger topic); check --group (source.group)"
            + ("" if args.wait else ", or --wait SECONDS for members starting")
        )
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0], indent=1, default=str))
    else:
        print("\n\n".join("\n".join(format_group_status(s)) for s in out))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    """``panagg history``: the ledgered releases window by window, optionally plotted."""
    from pathlib import Path

    from .status import StatusError, _ledger, format_history, plot_history, release_history

    if not 0 < args.level < 1:
        raise UsageError(f"--level must be between 0 and 1 (e.g. 0.9), got {args.level:g}")
    if args.group:
        rows = _group_history(args)
    elif not args.state_dir:
        raise UsageError(
            "give --state-dir (one process) or --group with --bootstrap (a group "
            "with scale.store = kafka)"
        )
    else:
        saved = Path(args.state_dir) / "ledger.jsonl"
        if not saved.exists():
            member = _member_group(args.state_dir)
            if member is not None:
                raise UsageError(
                    f"{args.state_dir} is the scratch directory of a member of group "
                    f"{member[0]!r}, whose ledger is in Kafka: run panagg history "
                    f"--group {member[0]} --bootstrap {member[1]}"
                )
        try:
            rows = release_history(_ledger(Path(args.state_dir)), level=args.level)
        except StatusError as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("\n".join(format_history(rows)))
    if args.plot:
        if Path(args.plot).exists():
            raise UsageError(f"{args.plot} exists; give a new file name for the plot")
        if not rows:
            raise UsageError("no releases in the ledger yet: nothing to plot")
        plot_history(rows, args.plot)
        # the table is on stdout, the note on stderr: flushed first, so that the note starts on
        # a line of its own when both go to one terminal or file
        sys.stdout.flush()
        print(f"\nplot written to {args.plot}", file=sys.stderr)
    return 0


def _member_group(state_dir: str) -> tuple[str, str] | None:
    """(group, bootstrap) if ``state_dir`` is a Kafka-only group member's scratch directory
    (its saved config says scale.partitioned), else None."""
    try:
        saved = _load(argparse.Namespace(config=None, set=None), [], state_dir=state_dir)
    except (UsageError, OSError, ValueError):
        return None
    if not saved.scale.partitioned:
        return None
    return saved.source.group, saved.source.bootstrap


def _group_history(args: argparse.Namespace) -> list[dict]:
    """``panagg history --group G --bootstrap B``: a Kafka-only group's releases, from Kafka."""
    from .group.status import group_release_history

    cfg = _load(args, [])
    boot = args.bootstrap or cfg.source.bootstrap
    problem = probe_bootstrap(boot, 5.0)
    if problem:
        raise UsageError(problem)
    try:
        return group_release_history(
            boot, args.group, cfg.security, aggregation=args.aggregation or "", level=args.level
        )
    except LookupError as exc:
        raise UsageError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="panagg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"panagg {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the full pipeline on synthetic login events (no Kafka)")
    demo.add_argument("--events", type=_positive_int, default=1_000_000, help="events in total")
    demo.add_argument("--accounts", type=_positive_int, default=100_000, help="domain size D")
    demo.add_argument("--zipf", type=_positive_float, default=1.1, help="Zipf exponent")
    demo.add_argument("--epsilon", type=_positive_float, default=1.0, help="privacy parameter")
    demo.add_argument("--model", choices=("joint", "state-only"), default="joint")
    demo.add_argument("--windows", type=_positive_int, default=1, help="tumbling windows")
    demo.add_argument("--output", default="out/releases", help="directory for release files")
    demo.add_argument(
        "--seed",
        type=_non_negative_int,
        default=None,
        help="the synthetic data's seed (default: fresh; printed either way)",
    )
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser("run", help="run the service (config TOML + PANAGG_* env + flags)")
    run.add_argument("--config", help="TOML config file (see docs/configuration.md)")
    run.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable)",
    )
    run.add_argument("--bootstrap", help="Kafka bootstrap servers (source.bootstrap)")
    run.add_argument("--topic", help="Kafka topic to count (source.topic)")
    run.add_argument("--epsilon", type=_positive_float, help="state.epsilon")
    run.add_argument("--state-dir", help="checkpoint.dir")
    run.add_argument("--release-dir", help="release.dir")
    run.add_argument("--metrics-port", type=int, help="metrics.port (0 any, -1 off)")
    run.add_argument(
        "--exit-when-idle",
        type=_positive_float,
        metavar="SECONDS",
        help="stop after this long without events (the open window is replayed "
        "from the source at the next start; a group's leader also waits "
        "until no complete window waits for its release)",
    )
    run.add_argument(
        "--fresh-start",
        action="store_true",
        help="start without a checkpoint although the ledger or the consumer group "
        "show earlier runs: counting resumes after the last released source "
        "position (events already released are never counted again); the "
        "lost checkpoint's open window is not released (recorded in the "
        "ledger)",
    )
    run.add_argument(
        "--accept-change",
        action="store_true",
        help="accept settings that differ from those the state directory was "
        "created with (recorded in the ledger); every release still asks "
        "the ledger (and the budget registry: ledger.registry_topic for "
        "Kafka, ledger.file_registry for files) about the records it covers, "
        "so none goes over ledger.budget_per_event across the change. A new "
        "source.path keeps the charges of a file with the same content "
        "(renamed, moved or grown; not with an empty ledger.file_registry, and "
        "not a copy read by another user or host unless the registry file "
        "is shared). A new source.topic counts as NEW data (copies of "
        "released records are released again; a warning says so) unless "
        "--same-records-as names the old topic",
    )
    run.add_argument(
        "--same-records-as",
        metavar="OLD_TOPIC",
        help="with --accept-change on source.topic: the new topic holds copies of "
        "OLD_TOPIC's records, so each of its records is charged as the most "
        "charged record of OLD_TOPIC (its offsets need not match the "
        "original's); recorded in the ledger, later starts keep it",
    )
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(func=cmd_run)

    kg = sub.add_parser(
        "shuffle-keygen",
        help="new analyzer key pair for the shuffle model: "
        "private key to a new file, public key (hex) "
        "to stdout",
    )
    kg.add_argument("--out", required=True, help="private key file to create (mode 0600)")
    kg.set_defaults(func=cmd_shuffle_keygen)

    sh = sub.add_parser(
        "shuffle",
        help="the shuffle model's shuffler: client topic -> permuted "
        "windows on the analyzer topic (Kafka transactions)",
    )
    sh.add_argument("--config", required=True)
    sh.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    sh.add_argument(
        "--exit-when-idle",
        type=float,
        metavar="SECONDS",
        help="stop after this long without client records (the open window is read "
        "again at the next start)",
    )
    sh.add_argument("--metrics-port", type=int, help="metrics.port (0 any, -1 off)")
    sh.add_argument("-v", "--verbose", action="store_true")
    sh.set_defaults(func=cmd_shuffle)

    sc = sub.add_parser(
        "shuffle-clients",
        help="load generator: many shuffle-model clients "
        "producing sealed events to shuffle.client_topic",
    )
    sc.add_argument("--config", required=True)
    sc.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    sc.add_argument("--events", type=int, required=True)
    sc.add_argument("-v", "--verbose", action="store_true")
    sc.set_defaults(func=cmd_shuffle_clients)

    st = sub.add_parser(
        "shuffle-topics",
        help="create the shuffle model's client, analyzer (1 partition) and dead-letter topics",
    )
    st.add_argument("--config", required=True)
    st.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    st.add_argument("--bootstrap", help="source.bootstrap")
    st.add_argument("--client-partitions", type=int, default=6)
    st.add_argument("--replication-factor", type=int, default=1)
    st.set_defaults(func=cmd_shuffle_topics)

    sr = sub.add_parser(
        "shuffle-recover",
        help="release refused shuffle windows once the cause "
        "is fixed (the analyzer must be stopped)",
    )
    sr.add_argument("--config", required=True)
    sr.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    sr.add_argument("--state-dir", help="checkpoint.dir of the analyzer")
    sr.add_argument("--bootstrap", help="source.bootstrap")
    sr.add_argument(
        "--window",
        type=int,
        action="append",
        help="a refused window's number (repeat; default: every refused window)",
    )
    sr.add_argument("-v", "--verbose", action="store_true")
    sr.set_defaults(func=cmd_shuffle_recover)

    rel = sub.add_parser("release", help="close the current window now and publish its release")
    rel.add_argument("--config")
    rel.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    rel.add_argument("--state-dir", help="checkpoint.dir")
    rel.set_defaults(func=cmd_release)

    aud = sub.add_parser("audit", help="signed state exports for auditors")
    aud_sub = aud.add_subparsers(dest="audit_command", required=True)
    exp = aud_sub.add_parser("export", help="write a signed, ledgered snapshot of the live state")
    exp.add_argument("--config")
    exp.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    exp.add_argument("--state-dir", help="checkpoint.dir")
    ver = aud_sub.add_parser("verify", help="check an export's signature")
    ver.add_argument("file")
    ver.add_argument("--key-file", help="hex key file (or PANAGG_AUDIT_KEY)")
    show = aud_sub.add_parser("show", help="print an export's metadata and counter summary")
    show.add_argument("file")
    show.add_argument("--counters", metavar="NPY", help="also save the noisy counters to NPY")
    aud.set_defaults(func=cmd_audit)
    led = sub.add_parser("ledger", help="the privacy ledger of a state directory")
    led_sub = led.add_subparsers(dest="ledger_command", required=True)
    shw = led_sub.add_parser("show", help="releases, refusals, exports, restarts; eps spent")
    shw.add_argument("--state-dir", required=True, help="checkpoint.dir")
    shw.add_argument("--json", action="store_true", help="entries as JSON (documents omitted)")
    mig = led_sub.add_parser(
        "migrate",
        help="rewrite a format-1 ledger with its hash chain and "
        "source ranges (keeps the original as .v1)",
    )
    mig.add_argument("--state-dir", required=True, help="checkpoint.dir")
    led.set_defaults(func=cmd_ledger)
    pla = sub.add_parser(
        "plan",
        help="expected accuracy of a configuration before any data "
        "(error floor, events a window needs, a suggested fix)",
    )
    pla.add_argument("--config", help="TOML config file")
    pla.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable)",
    )
    pla.set_defaults(func=cmd_plan)
    est = sub.add_parser(
        "estimators", help="the estimators release.estimator names, from the estimators' registry"
    )
    est.set_defaults(func=cmd_estimators)
    sta = sub.add_parser(
        "status", help="window, progress, lag, health, budget and last release of a state directory"
    )
    sta.add_argument(
        "--state-dir",
        help="checkpoint.dir (one process, or the shared directory of scale.store = directory)",
    )
    sta.add_argument(
        "--group",
        help="a scale-out group with scale.store = kafka (source.group): "
        "members, partitions, backlog, waiting windows, from Kafka",
    )
    sta.add_argument("--bootstrap", help="with --group: the Kafka bootstrap servers")
    sta.add_argument("--topic", help="with --group: the source topic (for the intake backlog)")
    sta.add_argument("--config", help="with --group: a config file (security settings)")
    sta.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="with --group: override one setting (repeatable)",
    )
    sta.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --group: wait up to SECONDS for members started just now to "
        "make the group's topics, write its identity and hold every "
        "partition",
    )
    sta.add_argument("--json", action="store_true", help="the same as JSON")
    sta.set_defaults(func=cmd_status)
    his = sub.add_parser("history", help="ledgered releases window by window (and a plot)")
    his.add_argument("--state-dir", help="checkpoint.dir (one process)")
    his.add_argument(
        "--group",
        help="a scale-out group with scale.store = kafka (source.group): "
        "its releases, from its ledger and releases topics",
    )
    his.add_argument("--bootstrap", help="with --group: the Kafka bootstrap servers")
    his.add_argument("--aggregation", help="with --group: one aggregation of several (its name)")
    his.add_argument("--config", help="with --group: a config file (security settings)")
    his.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="with --group: override one setting (repeatable)",
    )
    his.add_argument("--json", action="store_true", help="rows as JSON")
    his.add_argument(
        "--plot",
        help="write distinct items and entropy across windows to this PNG "
        "(intervals as bands, significant changes marked)",
    )
    his.add_argument(
        "--level",
        type=float,
        default=0.9,
        help="level of the change test between consecutive releases (default 0.9: "
        "at most 10%% false alarms on a stationary stream)",
    )
    his.set_defaults(func=cmd_history)
    cen = sub.add_parser(
        "central", help="central-model DP release of a file of counts (trusted curator)"
    )
    cen.add_argument("--input", required=True, help="CSV or JSON of counts or prevalences")
    cen.add_argument(
        "--form",
        choices=FORMS,
        default=None,
        help="what the input holds: counts (one column, one count per item), "
        "per-item (item, count), prevalences (r, phi_r); needed for a "
        "two-column CSV whose header does not say",
    )
    cen.add_argument("--epsilon", type=_positive_float, required=True)
    cen.add_argument(
        "--algorithm",
        choices=("auto", "dpanonhist", "privhist"),
        default="auto",
        help="auto: DPAnonHist (Manurangsi) for eps >= 1, else PRIVHIST (Suresh)",
    )
    cen.add_argument(
        "--public-n",
        type=_positive_int,
        default=None,
        help="a PUBLIC bound on the number of events (DPAnonHist only; otherwise "
        "n is estimated privately)",
    )
    cen.add_argument("--name", default="central", help="release name (file stem suffix)")
    cen.add_argument("--output", default="out/releases", help="directory for release files")
    cen.set_defaults(func=cmd_central)
    return parser


TOP_LEVEL = ("aggregator", "consumers", "state_store")  # panagg's import names (generic ones)


def import_clash() -> str | None:
    """The line to refuse to run with when one of panagg's generic top-level packages comes
    from somewhere else (another distribution installed into the same environment overwrote or
    shadows it): the service would otherwise run someone else's code under panagg's name."""
    import importlib.util
    from importlib.metadata import packages_distributions
    from pathlib import Path

    roots = {}
    for name in TOP_LEVEL:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec and spec.origin else None
        roots[name] = Path(origin).resolve().parent.parent if origin else None
    if len(set(roots.values())) > 1 or None in roots.values():
        where = ", ".join(f"{k} from {v}" for k, v in roots.items())
        return (
            f"panagg's packages come from different places ({where}): another install "
            "shadows one of them; install panagg in its own virtual environment "
            "(python -m venv)"
        )
    owners = packages_distributions()  # reads every installed distribution's file list: once
    others = {
        name: sorted({d for d in owners.get(name, []) if d.lower() != "panagg"})
        for name in TOP_LEVEL
    }
    clash = {k: v for k, v in others.items() if v}
    if clash:
        what = "; ".join(f"{k!r} also by {', '.join(v)}" for k, v in clash.items())
        return (
            f"top-level package names of panagg are installed by other distributions too "
            f"({what}): one overwrote the other's files; install panagg in its own virtual "
            "environment (python -m venv)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    clash = import_clash()
    if clash:
        print(f"panagg: error: {clash}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"panagg: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        from ..release import ReleaseExists

        if isinstance(exc, ReleaseExists):
            print(f"panagg: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
            return 2
        print(
            f"panagg: error: {exc.strerror or exc} ({exc.filename or ''}); check the path "
            "and its permissions",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:
        # conditions the user can act on, raised deep in the service: one line, exit 2
        from state_store.local import CheckpointError

        from consumers.kafka.kafka_python import PartialAssignment

        from ..state import SnapshotError
        from .ledger import LedgerError
        from .errors import ServiceError

        if isinstance(
            exc, (ServiceError, CheckpointError, SnapshotError, PartialAssignment, LedgerError)
        ):
            print(f"panagg: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
