"""Event sources behind one small interface: ``iter_batches()`` yields lists/arrays of items.

Present: the synthetic login-event generator. The Kafka and file/stdin sources are the streaming
service's issue.
"""
