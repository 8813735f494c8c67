"""The switches of the ledger's cuts of Faust's per-message costs.

On a slow 2-core box one ledger worker spent about 250 us of Faust's own time per
consumed message and about 300 us per table write, capping it near 1,800 completion
events/s (bench/ledger.py; py-spy profiles). Two cuts remove most of it, each
keeping Faust's guarantees: delivery without four asyncio tasks per message
(:class:`tokenbudget.streams.faust_adapt.consumer.FastDeliveryConsumer`) and table changes
written as record batches (:func:`tokenbudget.streams.faust_adapt.producer.write_changelog`).
``bench/ledger.py --without`` turns them off to measure each against stock Faust;
a cut that stops showing a benefit there goes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HotPath:
    """Which of Faust's per-message costs the ledger cuts: all of them, except where
    ``bench/ledger.py --without`` turns one off."""

    fast_delivery: bool = True  # FastDeliveryConsumer instead of LedgerConsumer
    changelog_batches: bool = True  # write_changelog instead of Table.send_changelog

    @classmethod
    def without(cls, names: set[str]) -> HotPath:
        """Every cut except those named (field names of this class)."""
        unknown = names - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"no such hot-path cut: {', '.join(sorted(unknown))}")
        return cls(**{name: False for name in names})
