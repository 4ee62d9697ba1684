"""Fixtures of the integration tests: one SparkSession for every Spark test.

A JVM start costs ~20 s, so every test of ``test_spark_*.py`` shares one session, started on
first use: ``local[2]`` with the settings that make tiny jobs fast (two shuffle partitions, no
UI, adaptive execution off: it plans each shuffle as a job of its own, and these inputs are
tiny), the JIT at its first tier, which starts short jobs several times faster, and no generated
code (compiling each query's Java costs more than interpreting it over a few thousand rows: the
Spark tests took 120 s instead of 165 s at load 3-5; real runs keep Spark's codegen). pyspark and
Java come with the test command (``scripts/test.sh``: the ``spark`` extra, ``bootstrap.sh --java``),
so their absence fails the tests, with the fix, instead of skipping them.
"""

from __future__ import annotations

import importlib.util

import pytest

#: Spark settings of the shared test session (``detfp_analyze.spark.session`` adds the quiet ones).
SPARK_TEST_CONF = (
    ("spark.sql.shuffle.partitions", "2"),
    ("spark.sql.adaptive.enabled", "false"),
    # The first JIT tier alone gets the small code cache of a one-tier JVM (48 MiB), which the
    # interpreted queries of a whole test session fill ("Out of space in CodeCache"): reserve more.
    ("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=256m"),
    ("spark.sql.codegen.wholeStage", "false"),
    ("spark.sql.codegen.factoryMode", "NO_CODEGEN"),
)


@pytest.fixture(scope="session")
def spark():
    """The shared SparkSession (``local[2]``); fails with the install command when pyspark or Java is missing."""
    if importlib.util.find_spec("pyspark") is None:
        pytest.fail("pyspark is not installed: run bash scripts/bootstrap.sh (it installs the spark extra)", pytrace=False)
    from detfp_analyze.errors import EngineError
    from detfp_analyze.spark.runtime import check_java, quiet_jvm, session

    try:
        check_java()
    except EngineError as exc:
        pytest.fail(str(exc), pytrace=False)
    with quiet_jvm():
        s = session("local[2]", SPARK_TEST_CONF)
    yield s
    s.stop()
