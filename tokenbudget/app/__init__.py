"""The application: what the commands run.

``assembly`` wires each role (producer, dispatcher, sink) from the config, for
``run`` and the single-role commands alike; ``runner`` starts a whole run, with
``supervision`` and ``children`` (its ledger workers and extra dispatchers),
``drain`` (when it is done), ``run_metrics`` and ``run_report`` (what it did);
``control`` publishes budgets and changes them, ``status`` and ``progress`` follow
a run, ``report`` prints its tables, ``bootstrap`` turns ``[kafka] bootstrap`` into
an address (starting the local broker for ``"local"``).
It imports everything below it (core, ``streams``, ``producers``, ``sinks``, the
local broker launcher); nothing below imports it.
"""
