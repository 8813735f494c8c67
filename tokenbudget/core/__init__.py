"""The core every layer needs and nothing of the pipeline: errors, the config,
Kafka clients and topic administration, metrics, files, retries (see
docs/architecture.md).
"""
