"""One SparkSession for the whole test session: a JVM start costs ~10 s on two cores."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

try:  # without the spark extra these tests are not collected at all
    import pyarrow  # noqa: F401
    import pyspark.sql.datasource  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """``local[2,4]``: two cores, and a failed task is retried up to 4 times (in local mode
    the retry count comes from the master string, not ``spark.task.maxFailures``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from mqabstract.spark_sink import register

    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("mqabstract-sink-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.task.maxFailures", "4")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
