"""Replay events from a file or stdin: JSON lines or a msgpack stream.

The offset of a record is its index in the file (line number for JSON lines, object number for a
msgpack stream), so a restarted service skips exactly what its checkpoint already counted. Reading
a file shows a progress bar on stderr when stderr is a terminal (or ``progress=True``).
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import msgpack

from .base import Segment, Source

__all__ = ["FileSource"]


class FileSource(Source):
    """Records from ``path`` (``"-"`` for stdin).

    Parameters
    ----------
    path
        File path, or ``"-"`` for standard input.
    fmt
        ``"json"`` (one JSON document per line) or ``"msgpack"`` (concatenated msgpack objects).
    batch
        Records per segment.
    """

    def __init__(
        self, path: str, fmt: str = "json", batch: int = 65536, progress: bool | None = None
    ):
        if fmt not in ("json", "msgpack"):
            raise ValueError(f"format must be 'json' or 'msgpack', got {fmt!r}")
        self.path, self.fmt, self.batch = path, fmt, int(batch)
        self.partition = f"file:{os.path.basename(path) if path != '-' else 'stdin'}"
        self._start = 0
        self._it = None
        self._total_bytes = None
        self._progress = sys.stderr.isatty() if progress is None else progress
        self._last_progress = 0.0
        self._pos_bytes = 0

    def seek(self, offsets: dict[str, int]) -> None:
        self._start = int(offsets.get(self.partition, 0))

    def _records(self):
        """Yield (offset, raw bytes, byte position) from the beginning."""
        if self.path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._total_bytes = size
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if self.fmt == "json":
            pos, index = 0, 0
            while pos < len(data):
                end = data.find(b"\n", pos)
                end = len(data) if end < 0 else end
                line = data[pos:end]
                pos = end + 1
                if line.strip():
                    yield index, bytes(line), pos
                    index += 1
        else:
            unpacker = msgpack.Unpacker(raw=False, max_buffer_size=0)
            unpacker.feed(data)
            index, start = 0, 0
            while start < len(data):
                try:
                    unpacker.skip()
                except msgpack.OutOfData:  # truncated tail: one undecodable record
                    yield index, bytes(data[start:]), len(data)
                    return
                except Exception:  # garbage: the rest cannot be framed; one undecodable record
                    yield index, bytes(data[start:]), len(data)
                    return
                end = unpacker.tell()
                yield index, bytes(data[start:end]), end
                index, start = index + 1, end

    def poll(self, timeout_s: float = 1.0) -> list[Segment]:
        if self.exhausted:
            return []
        if self._it is None:
            self._it = self._records()
        offsets, values = [], []
        for offset, raw, pos in self._it:
            if offset < self._start:
                continue
            offsets.append(offset)
            values.append(raw)
            self._pos_bytes = pos
            if len(values) >= self.batch:
                break
        else:
            self.exhausted = True
        self._show_progress()
        return [Segment(self.partition, offsets, values)] if values else []

    def _show_progress(self) -> None:
        if not self._progress or not self._total_bytes:
            return
        now = time.monotonic()
        if now - self._last_progress < 0.2 and not self.exhausted:
            return
        self._last_progress = now
        frac = min(self._pos_bytes / self._total_bytes, 1.0)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r  [{bar:<30}] {100 * frac:5.1f}% of {self.path}")
        if self.exhausted:
            sys.stderr.write("\n")
        sys.stderr.flush()
