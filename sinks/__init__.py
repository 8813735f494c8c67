"""Where kept completions go: the Parquet sink (``parquet``), replay of the
completions topic (``replay``) and the export for training (``export``). The
Prometheus metrics are in :mod:`tokenbudget.core.metrics`."""
