"""Everything the ledger changes in faust-streaming, mode-streaming and aiokafka, in
one place: what differs from stock Faust, and why, is read here.

Correctness (each closes a way Faust lost or mis-attributed events on a real broker):

* :mod:`.flow`: stream queues survive a flow resume (``LedgerApp.flow_control``).
* :mod:`.consumer`: a source partition never committed is sought to its beginning;
  the livelock check skips partitions without a position (``LedgerConsumer``).
* :mod:`.producer`: Faust's producer is idempotent (``LedgerProducer``).
* :mod:`.ownership`: aiokafka's heartbeat is watched, so an expelled worker knows.
* :mod:`.recovery`: table recovery keeps the newer owner's value.
* Faust's producer buffer holds 20,000 messages (:func:`install`).

Speed (switches in :mod:`.hot_path`, measured by ``bench/ledger.py --without``):
delivery without four tasks per message (:mod:`.consumer`), changelog writes as
record batches (:mod:`.producer`).

Importing this package changes nothing in those libraries; :func:`install` (once per
process, before the app is built) checks their versions (:mod:`.versions`) and
applies the one process-wide change. Per-app changes are made on the app itself
(:func:`use_ledger_clients`, :func:`.recovery.recover_preferring`). Every call site
these rely on is exercised against the installed libraries in
``tests/streams/faust_adapt/``.
"""

from __future__ import annotations

from collections.abc import Callable

import faust
from faust.transport.producer import ProducerBuffer

from tokenbudget.streams.faust_adapt.consumer import FastDeliveryConsumer, LedgerConsumer
from tokenbudget.streams.faust_adapt.flow import LedgerApp
from tokenbudget.streams.faust_adapt.hot_path import HotPath
from tokenbudget.streams.faust_adapt.ownership import Ownership
from tokenbudget.streams.faust_adapt.producer import (
    LedgerProducer,
    changelog_key_encoder,
    kafka_producer,
    write_changelog,
)
from tokenbudget.streams.faust_adapt.recovery import recover_preferring
from tokenbudget.streams.faust_adapt.versions import check_versions, installed_version

__all__ = [
    "PRODUCER_BUFFER_MESSAGES",
    "HotPath",
    "LedgerApp",
    "Ownership",
    "changelog_key_encoder",
    "install",
    "kafka_producer",
    "recover_preferring",
    "use_ledger_clients",
    "write_changelog",
]

# Faust holds every message delivery while more than this many of its own sends
# (announcements, snapshots, dead letters) are unsent; its default of 100 stalls
# the ledger whenever the broker is slow, as in a broker restart.
PRODUCER_BUFFER_MESSAGES = 20_000


def install(version_of: Callable[[str], str] = installed_version) -> None:
    """Refuse library versions other than the pinned ones (``FaustVersionError``),
    then apply the process-wide change: Faust's ``ProducerBuffer`` (a class
    attribute, shared by every app in the process) holds
    :data:`PRODUCER_BUFFER_MESSAGES`. Idempotent."""
    check_versions(version_of)
    ProducerBuffer.max_messages = PRODUCER_BUFFER_MESSAGES


def use_ledger_clients(app: faust.App, hot_path: HotPath) -> None:
    """Have ``app``'s worker build the ledger's consumer and producer (it builds them
    from these transport attributes when it starts)."""
    consumer = FastDeliveryConsumer if hot_path.fast_delivery else LedgerConsumer
    app.transport.Consumer = consumer  # type: ignore[misc]
    app.transport.Producer = LedgerProducer  # type: ignore[misc]
