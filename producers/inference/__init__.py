"""The inference client room: how a request reaches a server and what comes back.

The servers' wire formats behind one interface (``backends``), the HTTP client they
speak through (``http``), the fleet of servers and their health (``fleet``,
``server_gate``, ``placement``) and the rule that marks a thinking answer unfinished
(``reasoning``). It knows nothing of Kafka's prompts or the budget.
"""
