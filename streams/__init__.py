"""The events and what every process knows of them: topics and consumer groups
(``topics``), event schemas (``events``), the budget policy (``budget``), the
ledger's rules (``ledger``), its Faust worker (``ledger_worker``, Faust adapted in
``faust_adapt``) and gauges (``ledger_gauges``), the budget board every process
reads (``budget_board``), and a few events published from outside a worker
(``publisher``)."""
