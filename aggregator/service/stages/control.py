"""Control requests to a running service: ``panagg release`` and ``panagg export`` ask through
files in ``checkpoint.dir/control`` (``KIND-ID.req``), the loop answers between polls.

Each turn (and while intake is paused for the budget) :meth:`ControlRequests.serve` runs every
request in name order and writes its answer ``KIND-ID.done`` (JSON, atomically: the CLI reads it
as soon as it exists), then removes the request. An unknown kind or a failed action is answered
with its error; a stop request (:class:`..errors.Stopping`) is not swallowed.

Durable writes: the answers (``{"ok": ..., "path"/"window"/"error": ...}``: a path, a window id
or an error line; never counts or payloads).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from state_store.audit import AuditKeyError
from state_store.local import atomic_write

from ..errors import Stopping

__all__ = ["ControlRequests", "service_key_error"]


def service_key_error(exc: Exception) -> str:
    """An audit-key problem of the running service, said so that the fix lands in the right
    place: the key is read by the service, not by the shell that asked for the export."""
    return (
        f"the running service cannot sign the export: {exc}. The key is read by the "
        "service from its own environment or its audit.key_file, not from this shell: set "
        "it there and restart the service"
    )


class ControlRequests:
    """The control directory of one service.

    Parameters
    ----------
    directory
        ``checkpoint.dir/control`` (made by the start).
    export
        ``export(request_id)``: writes an audit export, returns its path.
    release
        ``release()``: closes the open window; its release (``{"window": id}``), or None if the
        ledger refused it.
    """

    def __init__(
        self, directory: Path, *, export: Callable[[str], Path], release: Callable[[], dict | None]
    ):
        self.dir, self.export, self.release = Path(directory), export, release

    def serve(self) -> None:
        """Answer every request waiting in the directory."""
        for req in sorted(self.dir.glob("*.req")):
            kind, _, rid = req.stem.partition("-")
            done = req.with_suffix(".done")
            try:
                if kind == "export":
                    result = {"ok": True, "path": str(self.export(rid))}
                elif kind == "release":
                    rel = self.release()
                    result = (
                        {"ok": True, "window": rel["window"]}
                        if rel is not None
                        else {
                            "ok": False,
                            "error": "the privacy ledger refused the release "
                            "(budget spent); see the service log",
                        }
                    )
                else:
                    result = {"ok": False, "error": f"unknown request {kind}"}
            except Stopping:
                raise
            except AuditKeyError as exc:
                result = {"ok": False, "error": service_key_error(exc)}
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            # whole or not at all: the CLI reads the answer as soon as the file exists (a plain
            # write let it read an empty file: a JSONDecodeError trace, seen in the suite)
            atomic_write(done, [json.dumps(result).encode()])
            req.unlink(missing_ok=True)
