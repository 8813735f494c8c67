"""Parquet sink, Prometheus metrics and replay."""
