"""One SparkSession for the whole test session: a JVM start costs ~10 s on two cores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

try:  # without the spark extra these tests are not collected at all
    import pyarrow  # noqa: F401
    import pyspark.sql.datasource  # noqa: F401
except ImportError:
    from tests.brokers import in_ci

    if in_ci():  # CI installs the extra: missing Spark must fail, not vanish
        raise
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """``local[2,4]``: two cores, and a failed task is retried up to 4 times (in local mode
    the retry count comes from the master string, not ``spark.task.maxFailures``)."""
    from mqabstract.spark_sink.demo import spark_session

    session = spark_session(
        "local[2,4]", "mqabstract-sink-tests",
        **{"spark.task.maxFailures": "4", "spark.driver.memory": "1g"},
    )
    yield session
    session.stop()
