"""Flow control whose resume keeps the stream queues: a rebalance race in Faust that
loses source events, closed for the ledger.

Seen on the real broker, with a ledger restarted after SIGKILL that never applied the
completions published while it was down (bench/chaos.py hit the same: a ledger that
applied offsets 99..100 of a partition without 32..98).

Faust clears every stream queue when partitions are revoked, and again whenever the
flow resumes. When a rebalance ends with table recovery,
``Recovery.on_recovery_completed`` resumes the stream partitions, seeks them to their
committed offsets, and only then resumes the flow; records the fetcher delivered in
between (fetched *after* the seek) are dropped, and nothing seeks again.
:class:`ResumeKeepsQueued` keeps the revoke-time clear only. Whatever a queue holds at
a resume was delivered after that clear, from partitions this worker holds (the
fetcher drops records of other generations and paused partitions), so at worst it is
an event the seek delivers again, which the ledger skips by offset.
"""

from __future__ import annotations

import faust
from mode.utils.objects import cached_property
from mode.utils.queues import FlowControlEvent


class ResumeKeepsQueued(FlowControlEvent):
    """Flow control whose ``resume`` leaves the queues as they are; ``clear``
    (which Faust calls when partitions are revoked) still empties them."""

    def resume(self) -> None:
        self._suspend.clear()
        self._resume.set()


class LedgerApp(faust.App):
    """A Faust app whose stream queues are cleared on revoke only."""

    @cached_property
    def flow_control(self) -> FlowControlEvent:
        return ResumeKeepsQueued(loop=self.loop)
