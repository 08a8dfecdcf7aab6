"""The service around the DP core: source -> decode -> count -> checkpoint -> window -> release.

``aggregator`` itself holds the differential-privacy core (noise, hashing, the pan-private state,
estimators, large domains, central baselines, properties); this subpackage holds what runs it as a
service: configuration, the CLI, windows and checkpoints, the privacy ledger, metrics and
scale-out.
"""

from .errors import ServiceError
from .process import Aggregator
from .stages.state_dir import service_running

__all__ = ["Aggregator", "ServiceError", "service_running"]
