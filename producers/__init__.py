"""Everything before a completion exists, in three rooms.

``prompts`` (dataset rows to prompt events), ``inference`` (the client of the
inference servers) and ``dispatch`` (prompt events to requests and outcomes, joining
the other two). ``templates`` (the local tokenizer's chat template and counts) sits
below them all. The layers contract in ``pyproject.toml`` keeps the prompt producer and
the dispatcher apart.
"""
