"""How large what tokenbudget puts on Kafka may be, and how it is compressed: set
here once; topics, producers, consumers and the prompt producer's row check derive
from it.

* Every topic of a namespace accepts messages of up to :data:`MESSAGE_BYTES`
  (``max.message.bytes``; 8 MiB, the largest a managed cluster such as Confluent
  Cloud's standard tier allows); every producer sends records of up to that
  (``max_request_size``), and every consumer fetches that much per partition, so a
  record that was written can always be read back.
* A prompt event may take at most :data:`PROMPT_EVENT_BYTES`, half a message: its
  completion carries the prompt back (text and ids), and the other half is left
  for the answer (4 MiB, some 350,000 tokens of ids and text).
* A reply of an inference server read whole, and one line of a streamed reply (a
  cumulative SGLang chunk repeats the whole answer so far), may take at most
  ``[inference] max_reply_bytes`` (default :data:`REPLY_BYTES`, four times an
  answer's share of a message): an answer that fits a completion event fits it with
  its ids and text as the server writes them, escapes and counts included.
* A row whose prompt is over ``[producer] max_prompt_bytes`` of UTF-8 (default
  :data:`DEFAULT_PROMPT_BYTES`), or ``max_prompt_tokens`` once templated, is a bad
  row: skipped and dead-lettered with an excerpt of :data:`EXCERPT_CHARS`, or it
  stops the run.

Producers compress their batches (``[kafka] compression``, :data:`DEFAULT_COMPRESSION`);
the broker stores batches as they come and consumers decompress them, so every
client needs the codec libraries (``cramjam`` for aiokafka and Faust, ``zstandard``
and ``lz4`` for kafka-python), which are dependencies. The broker checks
``max.message.bytes`` against the compressed batch and the producers check
``max_request_size`` against the uncompressed record, so the producers' check is
the stricter one.
"""

from __future__ import annotations

from typing import Any, Literal

MiB = 1024 * 1024

#: every topic's ``max.message.bytes`` and every producer's ``max_request_size``
MESSAGE_BYTES = 8 * MiB
#: the topic setting that holds it
MESSAGE_BYTES_CONFIG = "max.message.bytes"
#: the most a prompt event (its text or messages, and its template ids) may take
PROMPT_EVENT_BYTES = MESSAGE_BYTES // 2
#: ``[inference] max_reply_bytes`` by default: 16 MiB, where the 4 MiB an answer may
#: take in a completion hold ~350,000 tokens of ids and text
REPLY_BYTES = 4 * (MESSAGE_BYTES - PROMPT_EVENT_BYTES)
#: ``[producer] max_prompt_bytes`` by default: beyond any model's context window
DEFAULT_PROMPT_BYTES = 1 * MiB
#: characters of a bad row kept in its dead letter
EXCERPT_CHARS = 2000
#: budgets and totals: the largest count an event carries, what int64 (Parquet, msgpack)
#: holds; the events' decoders refuse more, and the config any integer past it
MAX_TOKENS = 2**63 - 1
#: one request's counts and lengths (its max_new_tokens, a server's concurrency), as
#: wide as a token id: the events' decoders refuse more, and so does the config
MAX_COUNT = 2**31 - 1

#: ``[kafka] compression``: what every producer of ours compresses its batches with
Compression = Literal["zstd", "lz4", "gzip", "none"]
DEFAULT_COMPRESSION: Compression = "zstd"


def topic_configs() -> dict[str, str]:
    """The size settings of every topic tokenbudget creates."""
    return {MESSAGE_BYTES_CONFIG: str(MESSAGE_BYTES)}


def compression_type(compression: Compression) -> str | None:
    """``compression`` as aiokafka, kafka-python and Faust name it."""
    return None if compression == "none" else compression


def producer_options(compression: Compression) -> dict[str, Any]:
    """Sizes and compression, in the keywords aiokafka and kafka-python share."""
    return {"max_request_size": MESSAGE_BYTES, "compression_type": compression_type(compression)}


def fetch_options() -> dict[str, int]:
    """Fetch sizes for consumers of either library: a whole record per partition
    (brokers return an oversized first batch anyway, but a fetch this large takes
    one round trip where a smaller one would take several), four per response."""
    return {"max_partition_fetch_bytes": MESSAGE_BYTES, "fetch_max_bytes": 4 * MESSAGE_BYTES}


def excerpt(text: str) -> str:
    """At most :data:`EXCERPT_CHARS` of ``text``, saying how much was left out."""
    if len(text) <= EXCERPT_CHARS:
        return text
    return f"{text[:EXCERPT_CHARS]}... ({len(text) - EXCERPT_CHARS:,} more characters)"
