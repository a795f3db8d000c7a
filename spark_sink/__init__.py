"""PySpark sink: publish DataFrames through any shared mqabstract backend.

    from mqabstract.spark_sink import register
    register(spark)
    (df.selectExpr("to_json(struct(*)) AS value")
       .write.format("mqabstract").option("url", "sqlite:///data/mq.db")
       .option("topic", "orders.created").mode("append").save())

Delivery is at-least-once; every message carries a deterministic id so duplicates from
retried tasks or replayed micro-batches can be dropped. See ``docs/spark.md``.
Needs the ``spark`` extra (``pip install 'mqabstract[spark]'``).
"""

from __future__ import annotations

from .source import SHORT_NAME, MQDataSource, SinkCommit, check_schema, message_id, register

__all__ = ["SHORT_NAME", "MQDataSource", "SinkCommit", "check_schema", "message_id", "register"]
