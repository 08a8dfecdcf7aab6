"""source.start in the configuration (the broker side: tests/integration/test_start_kafka.py)."""

import pytest

from aggregator.service.config import ConfigError, load_config, parse_start


def test_parse_start():
    assert parse_start("earliest") == "earliest" and parse_start("latest") == "latest"
    assert parse_start("2026-11-20T00:00:00Z") == 1_795_132_800_000
    assert parse_start("2026-11-20T01:00:00+01:00") == 1_795_132_800_000


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["source.start=yesterday"], "earliest, latest or an ISO 8601 time"),
        (["source.start=2026-11-20T00:00:00"], "has no time zone"),
        (["source.kind=generator", "source.start=latest"], "applies to Kafka topics"),
    ],
)  # a Kafka-only group takes source.start for a new group: tests/test_group.py
def test_bad_start_is_one_line(sets, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, sets, env={})
