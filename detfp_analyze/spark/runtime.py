"""A quiet SparkSession for the CLI and tests, and Spark's failures as one-line typed errors.

``session(master, conf)`` checks for Java first (a missing JDK otherwise surfaces as an obscure
gateway error), then builds or reuses the process's SparkSession with what a byte-stable report
and a short start need: no UI, no console progress bar, log4j at ERROR from the first line (a
properties file next to this module, passed to the driver JVM), Python-side query-context logs
off, UTC session time zone. ``quiet_jvm`` sends the JVM's own stderr (start-up banners, stack
traces) to a log file instead of the terminal; the CLI uses it. ``spark_errors`` turns any
exception Spark raises into a ``ShardError`` (a shard's data cannot be decoded: the local
engine's message), ``QueryError`` or ``EngineError`` whose one line carries Spark's first line
of reason, never a JVM stack trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from detfp_analyze._deps import require
from detfp_analyze.errors import EngineError, QueryError, ShardError

__all__ = ["JAVA_HINT", "check_java", "local_cores", "quiet_jvm", "session", "spark_errors", "spark_reason"]

#: How to get Java when it is missing (the Spark engine needs a JDK 17 or later on PATH or in JAVA_HOME).
JAVA_HINT = (
    "the Spark engine needs Java 17 or later (java on PATH or JAVA_HOME); install a JDK, e.g. "
    "apt-get install openjdk-17-jre-headless, or brew install openjdk@17"
)
_LOG4J = Path(__file__).with_name("log4j2.properties")
_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
#: Settings every detfp session gets unless the caller's --conf says otherwise.
_DEFAULTS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # Small jobs: the default 200 shuffle partitions cost more in task overhead than they split
    # (a local master gets one per core instead: local_cores).
    "spark.sql.shuffle.partitions": "8",
    _JAVA_OPTIONS: f"-Dlog4j2.configurationFile=file:{_LOG4J}",
}
#: And on a local master (one machine, small jobs): list the shard files on the driver (above 32
#: paths Spark lists them with a job of its own, which costs more than the listing on one disk), and
#: no adaptive execution (it plans each shuffle as a separate job; these jobs are small).
_LOCAL = {
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "1000000",
    "spark.sql.adaptive.enabled": "false",
    # The walk's rank-steps come back to the driver by design (their narrow columns: ~1 GiB of
    # Arrow for 256 ranks x 20,000 records x 2 runs); on one machine the driver's memory is the
    # limit, not Spark's default 1 GiB cap on a job's results.
    "spark.driver.maxResultSize": "0",
}


def local_cores(master: str | None) -> int | None:
    """The cores of a ``local``, ``local[N]`` or ``local[*]`` master (``[N, F]`` too); None otherwise."""
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", (master or "").strip())
    if m is None:
        return None
    n = m.group(1)
    return 1 if n is None else (os.cpu_count() or 1) if n == "*" else max(int(n), 1)


def check_java() -> None:
    """EngineError with JAVA_HINT when no Java can be found (before Spark tries to start one)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return
    if shutil.which("java") is None:
        raise EngineError(f"Java not found: {JAVA_HINT}")


def _quiet_python() -> None:
    # PySpark logs every failed query with its JVM stack trace as JSON on stderr; the error
    # itself is raised (and translated) anyway.
    logging.getLogger("SQLQueryContextLogger").disabled = True
    logging.getLogger("py4j").setLevel(logging.ERROR)


def session(master: str | None = None, conf: Iterable[tuple[str, str]] = ()) -> Any:
    """The process's SparkSession (created on first use): ``master`` (default: Spark's own
    default, ``local[*]`` outside spark-submit) and ``conf`` (key, value) pairs over detfp's
    quiet defaults. Raises EngineError when Java is missing or Spark cannot start."""
    require("pyspark")
    from pyspark.sql import SparkSession

    _quiet_python()
    active = SparkSession.getActiveSession()
    if active is not None:  # a notebook's or spark-submit's session: use it as it is
        return active
    check_java()
    builder = SparkSession.builder.appName("detfp-analyze")
    if master:
        builder = builder.master(master)
    settings = dict(_DEFAULTS)
    if master and master.startswith("local"):
        settings.update(_LOCAL)
    cores = local_cores(master)
    if cores is not None:
        # One machine: one shuffle partition per core (each partition is a task; more only queue).
        settings["spark.sql.shuffle.partitions"] = str(cores)
    for k, v in conf:
        # Java options are added to the quiet logging option, not put in its place.
        settings[k] = f"{settings[k]} {v}" if k == _JAVA_OPTIONS else v
    for k, v in settings.items():
        builder = builder.config(k, v)
    with spark_errors("starting Spark"), warnings.catch_warnings():
        # pyspark warns about pandas versions it has not been tested with; detfp uses Arrow only.
        warnings.simplefilter("ignore", FutureWarning)
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextlib.contextmanager
def quiet_jvm(log: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """While the JVM starts inside this block, its stderr goes to ``log`` (default: a file in the
    temporary directory), not to the terminal: the JVM inherits file descriptor 2 when it is
    launched and keeps it. Yields the log's path."""
    path = Path(log) if log is not None else Path(tempfile.gettempdir()) / f"detfp-spark-{os.getpid()}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = os.dup(2)
    try:
        os.dup2(fd, 2)
        yield path
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def spark_reason(exc: BaseException) -> str:
    """Spark's reason for ``exc`` on one line: the first line of its message, error class kept,
    without the JVM stack trace or the SQLSTATE suffix."""
    text = str(exc).strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    if first.startswith("An error occurred while calling"):  # a raw Py4JJavaError: the Java line follows
        lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip() and not ln.strip().startswith("at ")]
        first = lines[0].lstrip(": ") if lines else first
    return " ".join(first.split(" SQLSTATE:")[0].split())[:400]


#: Spark's failures that mean a shard's data could not be read (not a problem of the engine).
_DAMAGED = re.compile(r"FAILED_READ_FILE|ParquetDecodingException|CANNOT_READ_FILE_FOOTER|not a Parquet file")


def _is_spark(exc: BaseException) -> bool:
    module = type(exc).__module__.split(".")[0]
    return module in ("pyspark", "py4j")


@contextlib.contextmanager
def spark_errors(doing: str, query: bool = False) -> Iterator[None]:
    """Re-raise an exception of Spark (pyspark or py4j) while ``doing`` as a one-line typed error:
    QueryError for a user's query (``query``), EngineError otherwise."""
    try:
        yield
    except Exception as exc:
        if not _is_spark(exc):
            raise
        reason = spark_reason(exc)
        if _DAMAGED.search(str(exc)):
            # The reader validated footers and commit logs; the data inside a shard is damaged. The
            # local engine's words for the same case (the CLI's message for a polars decode error).
            raise ShardError(
                f"a shard could not be decoded ({reason}); it is damaged: run detfp-analyze certify on each run, "
                "then delete the shard or re-run the capture"
            ) from None
        if query:
            raise QueryError(f"query failed: {reason}; list the views with: SHOW VIEWS (docs/spark.md)") from None
        raise EngineError(
            f"Spark engine failed while {doing}: {reason}; check --master and --conf, and that every "
            "executor can read the run directories (docs/spark.md)"
        ) from None
