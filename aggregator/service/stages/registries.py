"""The budget registries a start attaches to the release gate: one event, one charge across
lineages (docs/design ARCHITECTURE.md, "The budget registry"; state_store/registry.py).

A file source is known by its content (``ledger.file_registry``): :meth:`BudgetRegistries.
prepare_file` reads the registry file and identifies the input before the start's checks (a
renamed, moved or grown file, or one read from a new state directory, keeps its charges), and
:meth:`BudgetRegistries.carry_renamed_file` moves a renamed file's checkpoint positions to its
new name. A Kafka source is known by cluster, topic and partition (``ledger.registry_topic``).
:meth:`BudgetRegistries.attach` hands the registry to the :class:`..release_gate.ReleaseGate`,
which asks it before every release and gives it every charge.

Invariant: nothing is written before the start's checks passed; :meth:`prepare_file` only reads.
Durable writes (through the gate, not here): the registry's charge lines (ranges and eps, no
data).
"""

from __future__ import annotations

import logging
from pathlib import Path

from consumers.file_source import FileSource
from consumers.kafka_security import client_options
from state_store.registry import (
    FileBudgetRegistry,
    KafkaBudgetRegistry,
    RegistryError,
    default_file_registry,
)

from ..errors import ServiceError
from ..release_gate import ReleaseGate
from ..settings import Config
from ..window import WindowTask

__all__ = ["BudgetRegistries"]

log = logging.getLogger("panagg.service")


class BudgetRegistries:
    """The budget registry of one aggregation's source.

    Parameters
    ----------
    cfg
        The service's settings (``source``, ``ledger.file_registry``,
        ``ledger.registry_topic``, ``security``).
    directory
        ``checkpoint.dir`` (named in the registry as the deployment).
    source
        The event source (several aggregations: a view whose hub holds the real one).
    gate
        The release gate the registry is attached to (it sets ``gate.sources`` for a file).
    ledger
        This directory's ledger (read: which names a file's content had before).
    """

    def __init__(self, cfg: Config, directory: Path, source, gate: ReleaseGate, ledger):
        self.cfg, self.dir, self.source, self.gate, self.ledger = (
            cfg,
            Path(directory),
            source,
            gate,
            ledger,
        )
        #: a file source's budget registry, read at the start's checks (None: none)
        self.file: FileBudgetRegistry | None = None

    def _real_source(self):
        # (several aggregations read the source through a view of the one consumer's hub)
        return getattr(getattr(self.source, "hub", None), "source", self.source)

    def prepare_file(self) -> None:
        """A file source: read the registry file (``ledger.file_registry``), keyed by the input's
        content, so a renamed, moved or grown file, or one read from a new state directory,
        keeps its charges (state_store/registry.py, FileBudgetRegistry). Nothing is written
        before the start's checks passed (:meth:`attach`)."""
        self.file = None
        if self.cfg.source.kind != "file":
            return
        source = self._real_source()
        where = self.cfg.ledger.file_registry
        if not where or not isinstance(source, FileSource) or source.path == "-":
            return  # (records fed by the caller, aggregator.api: no file to know)
        path, part = source.path, source.partition
        where = default_file_registry() if where == "auto" else where
        reg = FileBudgetRegistry(
            where, {"state_dir": str(self.dir.resolve()), "file": str(Path(path).resolve())}
        )
        try:
            reg.open()
            cid = reg.identify(part, path)
        except RegistryError as exc:
            raise ServiceError(str(exc)) from None
        except OSError as exc:
            raise ServiceError(f"{path} cannot be read ({exc.strerror or exc})") from None
        if cid is None:
            return  # an empty file: nothing to charge yet (its identity is taken when it has)
        self.gate.sources = {part: cid}
        self.file = reg

    def carry_renamed_file(self, task: WindowTask) -> None:
        """A file source renamed or moved (``--accept-change`` on ``source.path``) whose content
        is the one this state directory read (the same content identity in its ledger): the
        checkpoint's positions of the old name are the new name's, so counting resumes where it
        was instead of counting the file again."""
        cids = dict(self.gate.sources)
        if not cids or self.file is None:
            return
        ((part, cid),) = cids.items()
        same = self.file.content_ids() | {cid}
        old = {
            p
            for e in self.ledger.entries
            for p, c in (e.get("sources") or {}).items()
            if c in same and p != part
        }
        for name in sorted(old):
            if name in task.offsets and part not in task.offsets:
                task.offsets[part] = task.offsets[name]
                starts = task.window.get("start_offsets")
                if isinstance(starts, dict) and name in starts:
                    starts[part] = starts[name]
                log.warning(
                    "%s has the content %s read as %s (ledger.file_registry): counting "
                    "resumes at its position %d",
                    part[5:],
                    self.dir,
                    name[5:],
                    task.offsets[part],
                )

    def resume_after_file(self, resume: dict[str, int], epsilon: float, budget: float) -> None:
        """Move ``resume`` (per partition, where a release of ``epsilon`` fits ``budget``) past
        what the file registry knows of the same content (read before, renamed, another state
        directory), with one line each."""
        registry = self.file
        if registry is None:
            return
        theirs = registry.resume_offsets(epsilon, budget=budget)
        for part, pos in theirs.items():
            if pos > resume.get(part, 0):
                resume[part] = pos
                log.warning(
                    "%s was read and released before (by %s, the budget registry %s): "
                    "counting starts after its last released position %d",
                    part[5:],
                    registry.who(registry.translate({part: [0, pos]}), registry.charges(set())),
                    registry.topic,
                    pos,
                )

    def close(self) -> None:
        """At the stop: close the registry attached to the gate (if any)."""
        if self.gate.registry is not None:
            self.gate.registry.close()

    def attach(self) -> None:
        """Once the start's checks passed: the file registry, or for a Kafka source the
        cluster's budget registry (``ledger.registry_topic``; state_store/registry.py), is read
        before every release and gets every charge."""
        cfg = self.cfg
        source = self._real_source()
        if self.gate.registry is not None:
            return
        if cfg.source.kind == "file":
            if self.file is not None:
                self.gate.attach_registry(self.file)
            return
        if not getattr(source, "is_kafka", False) or not cfg.ledger.registry_topic:
            return

        reg = KafkaBudgetRegistry(
            cfg.source.bootstrap,
            cfg.ledger.registry_topic,
            {"state_dir": str(self.dir.resolve()), "consumer_group": cfg.source.group},
            security=client_options(cfg.security),
            timeout_s=float(cfg.source.connect_timeout_s),
        )
        try:
            reg.open()
            self.gate.attach_registry(reg)
        except RegistryError as exc:
            reg.close()
            raise ServiceError(str(exc)) from None
