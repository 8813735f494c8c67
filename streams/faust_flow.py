"""Two rebalance races in Faust that lose source events, closed for the ledger.

Both were seen on the real broker, with a ledger restarted after SIGKILL that
never applied the completions published while it was down (bench/chaos.py hit the
same: a ledger that applied offsets 99..100 of a partition without 32..98).

* **The resume clears after the seek.** Faust clears every stream queue when
  partitions are revoked, and again whenever the flow resumes. When a rebalance
  ends with table recovery, ``Recovery.on_recovery_completed`` resumes the stream
  partitions, seeks them to their committed offsets, and only then resumes the
  flow; records the fetcher delivered in between (fetched *after* the seek) are
  dropped, and nothing seeks again. :class:`ResumeKeepsQueued` keeps the
  revoke-time clear only. Whatever a queue holds at a resume was delivered after
  that clear, from partitions this worker holds (the fetcher drops records of
  other generations and paused partitions), so at worst it is an event the seek
  delivers again, which the ledger skips by offset.
* **No committed offset, no seek.** During recovery the fetcher drops records of
  the paused stream partitions after fetching them, relying on the seek to
  committed offsets to fetch them again. A partition the group never committed
  (a ledger killed before its first commit) is not sought at all, so its position
  stays past the dropped records. :class:`LedgerConsumer` seeks such partitions
  to their beginning, where ``auto_offset_reset = earliest`` starts them anyway.

* **The livelock check reads a position not set yet.** Faust's commit livelock
  detector reads aiokafka's position of every assigned partition; one assigned a
  moment ago, in a rebalance as a second ledger worker joins, has none yet, and
  aiokafka's ``assert`` crashed the worker (seen in the two-worker cluster test).
  :class:`LedgerConsumer` skips the check for such partitions: they are not stuck,
  they have not started.

Written against faust-streaming 0.15 and mode 0.4 (pinned in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import faust
from aiokafka.structs import TopicPartition as AIOKafkaTopicPartition
from faust.transport.drivers.aiokafka import Producer as AIOKafkaProducer
from mode.utils.objects import cached_property
from mode.utils.queues import FlowControlEvent

from streams.faust_hot_path import FastDeliveryConsumer


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


def never_committed(committed: Mapping[Any, int | None], changelogs: set[str]) -> list[Any]:
    """The source partitions in ``committed`` (partition -> committed offset, as
    aiokafka's ``seek_to_committed`` returns it) without a committed position."""
    return [
        tp
        for tp, offset in committed.items()
        if (offset is None or offset <= 0) and tp.topic not in changelogs
    ]


def position_known(subscriptions: Any, tp: Any) -> bool:
    """Whether aiokafka's ``SubscriptionState`` has a fetch position for ``tp``."""
    subscription = subscriptions.subscription
    assignment = subscription.assignment if subscription is not None else None
    state = assignment.state_value(tp) if assignment is not None else None
    return state is not None and bool(state.has_valid_position)


class LedgerConsumer(FastDeliveryConsumer):
    """The ledger's consumer: a seek to committed offsets also rewinds the source
    partitions that have none, and the livelock check passes over partitions that
    have no position yet."""

    def verify_event_path(self, now: float, tp: Any) -> None:
        consumer = self._thread._ensure_consumer()
        aiotp = AIOKafkaTopicPartition(tp.topic, tp.partition)
        if not position_known(consumer._fetcher._subscriptions, aiotp):
            return None
        return super().verify_event_path(now, tp)

    async def seek_to_committed(self) -> Mapping[Any, int]:
        committed = await super().seek_to_committed()
        unsought = never_committed(committed, self.app.tables.changelog_topics)
        if unsought:
            await self._thread.seek_to_beginning(*unsought)
        return committed


class LedgerProducer(AIOKafkaProducer):
    """Faust's producer, idempotent: a send retried across a leader election or a
    lost connection is written once, not twice. Faust turns idempotence on only
    inside transactions (``_settings_extra``); its ``acks`` setting stays -1."""

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}
