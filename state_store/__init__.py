"""Snapshot stores. The state's own format is
:meth:`aggregator.state.PanPrivateHistogram.serialize`; the atomic directory store, checkpoints
and signed audit exports arrive with the streaming service.
"""
