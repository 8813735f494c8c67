"""Faust's per-message costs, cut out of the ledger's inner loop, and the switches
that turn each cut off.

On a slow 2-core box one ledger worker spent about 250 us of Faust's own time per
consumed message and about 300 us per table write, capping it near 1,800 completion
events/s (bench/ledger.py; py-spy profiles). The costs are bookkeeping, not work,
and each replacement keeps Faust's guarantees. Besides the consumer's delivery
(:class:`streams.faust_adapt.consumer.FastDeliveryConsumer`) and the changelog's
record batches (:func:`streams.faust_adapt.producer.write_changelog`):

* :class:`RawSchema` hands key and value over as the bytes they arrived as, instead
  of through two codec-registry lookups per message;
* :class:`QuietMonitor` keeps Faust's monitor out of the four sensor calls every
  message makes (only Faust's web views read it; the ledger serves none and keeps its
  metrics in tokenbudget/metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faust
from faust.sensors.monitor import Monitor


@dataclass(frozen=True)
class HotPath:
    """Which of Faust's per-message costs the ledger cuts: all of them, except where
    ``bench/ledger.py --without`` turns one off to measure it against stock Faust."""

    fast_delivery: bool = True  # FastDeliveryConsumer instead of LedgerConsumer
    quiet_monitor: bool = True  # QuietMonitor instead of Faust's Monitor
    raw_schema: bool = True  # RawSchema instead of faust.Schema
    changelog_batches: bool = True  # write_changelog instead of Table.send_changelog

    @classmethod
    def without(cls, names: set[str]) -> HotPath:
        """Every cut except those named (field names of this class)."""
        unknown = names - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"no such hot-path cut: {', '.join(sorted(unknown))}")
        return cls(**{name: False for name in names})

    @property
    def monitor(self) -> type[Monitor]:
        """The Faust monitor class (the app's ``Monitor`` setting)."""
        return QuietMonitor if self.quiet_monitor else Monitor

    @property
    def schema(self) -> type[faust.Schema]:
        """The schema class of the ledger's source topics."""
        return RawSchema if self.raw_schema else faust.Schema


class RawSchema(faust.Schema):
    """Message key and value as the bytes they arrived as."""

    def loads_key(
        self, app: Any, message: Any, *, loads: Any = None, serializer: Any = None
    ) -> Any:
        return message.key

    def loads_value(
        self, app: Any, message: Any, *, loads: Any = None, serializer: Any = None
    ) -> Any:
        return message.value


class QuietMonitor(Monitor):
    """Faust's monitor without its per-message bookkeeping."""

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        pass

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        return None

    def on_stream_event_out(
        self, tp: Any, offset: int, stream: Any, event: Any, state: Any = None
    ) -> None:
        pass

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        pass
