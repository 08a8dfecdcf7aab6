"""One Prometheus exposition for several aggregations: each one's series with its name as the
``aggregation`` label (several aggregations in one process, or in a group member). Writes
nothing; exports only what each aggregation's own metrics export (public-safe numbers)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

__all__ = ["ByAggregation"]


class ByAggregation:
    """A collector that exposes every aggregation's registry with an ``aggregation`` label."""

    def __init__(self, registries: dict[str, CollectorRegistry]):
        self.registries = registries

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, registry in self.registries.items():
            for fam in registry.collect():
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(
                        fam.name, fam.documentation, fam.type, fam.unit
                    )
                for s in fam.samples:
                    out.add_sample(
                        s.name, dict(s.labels, aggregation=name), s.value, s.timestamp, s.exemplar
                    )
        return list(families.values())
