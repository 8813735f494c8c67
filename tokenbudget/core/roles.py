"""The roles a process, or a part of ``run``, plays on Kafka.

Each role may log in as a principal of its own (``[[kafka.roles]]``), and Kafka's
ACLs keep each principal to the topics its role writes (docs/kafka.md, Roles and
ACLs): an operator's commands, the ledger's announcements, a dispatcher's answers
and leases, the producer's prompts, the sink's dead letters.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["operator", "producer", "dispatcher", "ledger", "sink"]
ROLES: tuple[Role, ...] = ("operator", "producer", "dispatcher", "ledger", "sink")
