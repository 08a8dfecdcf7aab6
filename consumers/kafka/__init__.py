"""Kafka sources: one interface, two clients (``source.client``).

* :mod:`.kafka_python`: kafka-python, pure Python (the default);
* :mod:`.confluent`: confluent-kafka on librdkafka, records parsed in C (an extra:
  ``pip install 'panagg[confluent]'``);
* :mod:`.compat`: the kafka-python private parts the service patches, checked at start;
* :mod:`.common`: what both name and say the same way.

Both give :class:`consumers.base.Segment` batches and the same methods (seek, pause/resume,
commit with the ledger's anchor as metadata, end and committed offsets, lag); the conformance
tests (tests/integration/test_kafka_clients.py) run the same checks against each on a real broker.
"""
