"""Publishing ledgered releases to their sinks: files in ``release.dir`` and a Kafka topic.

A release document reaches the publisher once the ledger holds it (the privacy decision is
made); from then on publishing is delivery only, retried until it succeeds. The two sinks are
independent: a release file is written as soon as its document is ledgered, whatever the
release topic's state, and the topic is retried on its own, in window order. A document is done
(and leaves the checkpoint's pending list) when every configured sink has it.

The rank-frequency plot next to each file is a convenience, drawn on a thread of its own so
that the consume loop never waits for matplotlib (the JSON is the release).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..release import plot_release, write_release

log = logging.getLogger("panagg.service")


class Backoff:
    """One log line per state change of a retried action, retries spaced 0.5 s -> 30 s (no
    log floods). ``failing`` says whether the last try failed; ``last_reason`` why."""

    def __init__(self, what: str):
        self.what, self.failing, self.delay, self.next_try = what, False, 0.5, 0.0
        self.last_reason = ""

    def ready(self) -> bool:
        return time.monotonic() >= self.next_try

    def failed(self, reason: str) -> None:
        self.last_reason = reason
        if not self.failing:
            log.warning("%s failed (%s); retrying with backoff", self.what, reason)
        self.failing = True
        self.next_try = time.monotonic() + self.delay
        self.delay = min(self.delay * 2, 30.0)

    def ok(self) -> None:
        if self.failing:
            log.info("%s works again", self.what)
        self.failing, self.delay, self.next_try = False, 0.5, 0.0


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    return type(exc).__name__


class _TopicSender:
    """Sends documents to the release topic in order on a thread of its own, retrying with
    backoff: a broker outage never blocks the consume loop (a send waits up to seconds for
    metadata)."""

    def __init__(self, topic: str, producer: Callable, key_of: Callable[[dict], str]):
        self.topic, self._producer, self._key_of = topic, producer, key_of
        self.backoff = Backoff(f"sending releases to topic {topic!r}")
        self._queue: deque[str] = deque()
        self._queued: set[str] = set()
        self.done: set[str] = set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="release-topic", daemon=True)
        self._thread.start()

    def put(self, doc: str) -> None:
        with self._cv:
            if doc not in self._queued and doc not in self.done:
                self._queued.add(doc)
                self._queue.append(doc)
                self._cv.notify()

    def take(self, doc: str) -> bool:
        """Whether ``doc`` was sent (forgotten here once taken)."""
        with self._cv:
            if doc in self.done:
                self.done.discard(doc)
                return True
            return False

    def retry_now(self) -> None:
        with self._cv:
            self.backoff.next_try = 0.0
            self._cv.notify()

    def drain(self, timeout_s: float) -> None:
        """Wait until everything queued was sent, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue and time.monotonic() < deadline:
                self._cv.wait(0.1)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._queue or not self.backoff.ready()):
                    self._cv.wait(0.2)
                if self._stop:
                    return
                doc = self._queue[0]
            release = json.loads(doc)
            try:
                producer = self._producer()
                producer.send(self.topic, key=self._key_of(release).encode(), value=doc.encode())
                producer.flush(timeout=5)
            except Exception as exc:
                with self._cv:
                    self.backoff.failed(f"window {release['window']}: {_reason(exc)}")
                continue
            with self._cv:
                self.backoff.ok()
                self._queue.popleft()
                self._queued.discard(doc)
                self.done.add(doc)
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=2)  # (a daemon: a send stuck on a dead broker ends with us)


class ReleasePublisher:
    """Deliver ledgered release documents to ``release_dir`` and, if ``topic``, to Kafka.

    Parameters
    ----------
    release_dir
        Where ``release-<window>.json`` (and its plot) go; a file is written once and never
        overwritten by a different document (:func:`aggregator.release.write_release`).
    topic
        The release topic, or ``""`` for files only.
    producer
        A callable returning the Kafka producer (made on first use).
    key_of
        The Kafka record key of a release (default: its window number).
    on_published
        Called with ``(release, path)`` when a release's file is written: metrics and the log
        line "published release of window ...".
    plot
        Draw each release's PNG plot (on a thread beside the loop).

    :meth:`publish` takes the pending documents in window order and returns those every sink
    now holds; call it again later with the rest (its backoffs say when a retry is due).
    """

    def __init__(
        self,
        release_dir,
        topic: str = "",
        *,
        producer: Callable | None = None,
        key_of: Callable[[dict], str] | None = None,
        on_published: Callable[[dict, Path], None] | None = None,
        plot: bool = True,
    ):
        self.release_dir, self.topic = release_dir, topic
        self._producer, self._key_of = producer, key_of or (lambda r: str(r["window"]))
        self._on_published = on_published
        self.files = Backoff("writing release files")
        self._filed: dict[str, Path] = {}
        self._plots = ThreadPoolExecutor(1, thread_name_prefix="release-plot") if plot else None
        self._sender = _TopicSender(topic, producer, self._key_of) if topic else None

    @property
    def last_reason(self) -> str:
        if self.files.failing or self._sender is None:
            return self.files.last_reason
        return (
            self._sender.backoff.last_reason
            or f"topic {self.topic!r} has not acknowledged them yet"
        )

    def due(self) -> bool:
        return self.files.ready() or self._sender is not None

    def publish(self, pending: list[str]) -> list[str]:
        """Write the files of the ``pending`` documents and queue them for the topic; the
        documents every sink now holds, in order (a prefix of ``pending``)."""
        if self.files.ready():
            for doc in pending:
                if doc in self._filed:
                    continue
                release = json.loads(doc)
                try:
                    path = write_release(release, self.release_dir, plot=False)
                except Exception as exc:  # retried with backoff; the document is durable
                    self.files.failed(f"window {release['window']}: {_reason(exc)}")
                    break
                self.files.ok()
                self._filed[doc] = path
                if self._sender is not None:
                    self._sender.put(doc)
                if self._plots is not None and "histogram" in release:  # (not distinct users)
                    self._plots.submit(self._plot, release)
                if self._on_published is not None:
                    self._on_published(release, path)
        done = []
        for doc in pending:
            if doc not in self._filed or (self._sender is not None and not self._sender.take(doc)):
                break
            done.append(doc)
            del self._filed[doc]
        return done

    def retry_now(self, wait_s: float = 0.0) -> None:
        """Retry at once; with ``wait_s``, give the topic that long to take what is queued."""
        self.files.next_try = 0.0
        if self._sender is not None:
            self._sender.retry_now()
            if wait_s:
                self._sender.drain(wait_s)

    def _plot(self, release: dict) -> None:
        try:
            plot_release(release, self.release_dir)
        except Exception as exc:  # a convenience: the JSON is the release
            log.warning("plot of window %s failed (%s)", release["window"], type(exc).__name__)

    def close(self) -> None:
        """Wait for the plots still being drawn; stop the topic's sender (what it did not send
        stays pending in the checkpoint)."""
        if self._sender is not None:
            self._sender.close()
        if self._plots is not None:
            self._plots.shutdown(wait=True)
