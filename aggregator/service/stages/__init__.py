"""The stages of the streaming engine, one concern a module, shared by every mode.

:class:`aggregator.service.process.Aggregator` was one class of about 100 methods. It is split
into the boxes of the design (ARCHITECTURE.md, "one engine"), each a small class with an
explicit constructor, so that the single process, several aggregations (``multi``), a group
member (``group``) and the shuffle analyzer (``analyzer``) differ in which stages they wire,
not in copies of them. The plan, by the concern each of the old methods served:

==========================  ===================================================================
concern                     stage
==========================  ===================================================================
state directory lock        :mod:`.state_dir` (claim, lock, remove what a refused start made)
the budget                  :mod:`.budget` (the privacy ledger, the release gate over it)
a start                     :mod:`.start` (every check writing nothing, then the restore that
                            writes; the ledger entries held meanwhile)
start-up checks, lineage    :mod:`.start_checks` (identity, anchors, start policy, rollback,
                            the restored state's settings, the saved config);
                            :mod:`.registries` (the file and Kafka budget registries)
resume at a start           :mod:`.resume` (checkpoint or first window; unreleased windows
                            queued, decided windows passed)
fresh states, noise         :mod:`.fresh_state` (each window's state, drawn ahead; the rng)
intake                      :mod:`.intake` (decode, count a segment, hold/release partitions);
                            :mod:`.caught_up` (the idle exit, the offline catch-up)
window assignment, clock    :mod:`.windows` (count, processing time, replay targets, snapshot
                            schedule; event time is ``..event_time``, opened through it)
checkpoints                 :mod:`.checkpoint` (the numbered commit sequence);
                            :mod:`.durable_write` (waiting for a write that fails: backoff,
                            readiness; the shuffle analyzer's checkpoints too)
close and release           :mod:`.close` (the order of release, next window, checkpoint;
                            backpressure); :mod:`.release` (the release in or beside the loop,
                            ledgered with its document); :mod:`.publish` (delivery, anchor);
                            the gate and worker stay in ``..release_gate``, ``..release_worker``;
                            :mod:`.producer` (the one Kafka producer, made on first use)
control requests            :mod:`.control` (``panagg release`` / ``panagg export``)
audit exports               :mod:`.export` (a signed layered snapshot, ledgered)
loop health                 :mod:`.health` (lag, broker state, progress, readiness, the pause
                            of intake when the budget is spent)
several aggregations        :mod:`.labelled` (one exposition, an ``aggregation`` label)
the loop itself             ``..process.Aggregator``: wires the stages; start, turn,
                            housekeeping, input's end, finish
==========================  ===================================================================

Not yet here (issue 47): the group's own windows, close and stores (``..group``) and the
analyzer's loop still have their own implementations; the stores (checkpoints, ledger, rollup
sums, snapshots, exports) are not yet behind one interface with a Kafka backend.

Rules of the package: a stage imports no mode (``process``, ``multi``, ``group``, ``analyzer``;
tests/test_stage_imports.py) and writes nothing durable that its docstring does not name;
nothing un-noised is written by any stage (the counters of an open window live in memory only:
``..process``'s module docstring).
"""
