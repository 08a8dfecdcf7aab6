"""The stages of the streaming engine, one concern a module, shared by every mode.

:class:`aggregator.service.process.Aggregator` was one class of about 100 methods. It is being
split into the boxes of docs (ARCHITECTURE.md, "one engine"), each a small class with an explicit
constructor, so that the single process, several aggregations (``multi``), a group member
(``group``) and the shuffle analyzer (``analyzer``) differ in which stages they wire, not in
copies of them. The plan, by the concern each of the old methods served:

==========================  ===================================================================
concern                     where it lives
==========================  ===================================================================
state directory lock        :mod:`.state_dir` (claim, lock, remove what a refused start made)
start-up checks, lineage    :mod:`.start_checks` (identity, anchors, start policy, rollback,
                            the file budget registry, the saved config)
loop health                 :mod:`.health` (lag, broker state, progress line, readiness, the
                            pause of intake when the budget is spent)
close and release           :mod:`.release` (the estimator choice shared by every mode); the
                            gate, worker and publisher stay in ``release_gate``,
                            ``release_worker`` and ``publisher``
metrics of several          :mod:`.labelled` (one exposition, an ``aggregation`` label)
aggregations
still in ``process``        intake (decode, count a segment, hold/release partitions), window
                            assignment and its clock (count, processing time; event time is
                            ``event_time``), the checkpoint sequence, close (in the loop and
                            beside it), audit exports and control requests
==========================  ===================================================================

Rules of the package: a stage imports no mode (``process``, ``multi``, ``group``, ``analyzer``)
and writes nothing durable that its docstring does not name; nothing un-noised is written by any
stage (the counters of an open window live in memory only: ``process``'s module docstring).
"""
