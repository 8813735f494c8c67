"""The dispatch room: prompt events in, inference requests out, outcomes back.

The dispatcher (``dispatcher``) reads prompts (``intake``), reserves budget before a
request is sent (``admission``, ``caps``), sends it through the inference client
(``route``, ``attempt``, ``tries``), keeps what the lease allows (``answers``),
publishes the outcome (``outcomes``, ``turns``) and commits in order (``offsets``),
with its places counted in ``slots`` and the steps' contract in ``step``.
"""
