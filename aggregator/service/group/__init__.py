"""Scale-out on Kafka alone (``scale.partitioned = true``, ``scale.store = "kafka"``).

Several ``panagg run`` members share one consumer group and nothing else: every durable and
shared piece (window positions, per-partition summaries, the privacy ledger, releases) lives in
internal Kafka topics, written in Kafka transactions together with the consumed offsets. Each
member keeps at most a local scratch directory. docs/scale-out.md describes the design.

Components, wired by :class:`~aggregator.service.group.service.GroupService`:

* :mod:`.topics` -- the internal topics' names (derived from the group) and their checks;
* :mod:`.repartition` -- source records -> counter indices, partitioned by index (any topic);
* :mod:`.counter` -- one pan-private state per repartition partition, for its slice of the
  domain; a closed window becomes a summary, written with the partition's offsets;
* :mod:`.leader` -- the ledger's authority: charges, merges and publishes each window;
* :mod:`.ledger_topic` -- the hash-chained ledger kept in a single-partition topic;
* event-time windows: :mod:`.watermark` (each record's window, the low watermark),
  :mod:`.closer` (the leader's close markers), :mod:`.event_windows` (a partition's open
  windows, closed at the markers).
"""
