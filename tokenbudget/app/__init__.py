"""The application: what the commands run.

``runner`` starts and supervises a whole run (ledger, dispatchers, sink, metrics),
``control`` the single-role commands and budget changes, ``status`` and
``progress`` follow a run, ``report`` prints its tables, ``bootstrap`` turns
``[kafka] bootstrap`` into an address (starting the local broker for ``"local"``).
It imports everything below it (core, ``streams``, ``producers``, ``sinks``, the
local broker launcher); nothing below imports it.
"""
