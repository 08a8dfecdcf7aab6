"""Helpers the test modules share (issue 52: no test module imports from another one).

- :mod:`tests.helpers.kafka`: topics, producers and the service as a subprocess on the session's
  real broker (``kafka_broker`` in tests/conftest.py);
- :mod:`tests.helpers.service`: the one-process service on files, its expected noise under
  ``testing.noise_seed`` and its ledger;
- :mod:`tests.helpers.event_time`: a scripted list source and the event-time reference windows;
- :mod:`tests.helpers.privacy`: the empirical epsilon of two neighbouring samples;
- :mod:`tests.helpers.group`: a scale-out group's member processes on the real broker, its
  topics read back, and the event-time reference windows of its tests.

tests/test_layering.py's ``test_no_test_module_imports_another`` keeps it so.
"""
