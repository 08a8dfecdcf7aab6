"""What the running service costs: throughput, latency, stalls at a window's close, hot-path
timings, recovery, scale-out, the fault matrix and the privacy audit of the service code. Several
need a Kafka broker (``PANAGG_KAFKA_BOOTSTRAP`` or one started from deploy/kafka). bench/README.md
lists the modules.
"""
