"""Where kept completions go: the sink seam (``base``) and the Parquet sink on it
(``parquet``), the rows they keep (``schema``, ``rows``), the replay of the
completions topic (``replay``, with ``replay_range`` and ``audit``; ``reading`` reads
topics whole) and the export for training (``export``, ``trainers``). The
Prometheus metrics are in :mod:`tokenbudget.core.metrics`."""
