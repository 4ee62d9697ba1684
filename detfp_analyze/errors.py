"""Typed errors of the analysis library. The CLI maps every one to exit code 2 and one line.

They derive from ``AnalysisError``, itself a ``DetfpError``: the root of every detfp package's
errors, defined in ``detfp_format.errors`` and exported here under the same name, so
``except DetfpError`` also catches the format's errors the analysis lets through (a
``SelectorError`` from a selector it parses).

Messages name the object, the problem and the fix, e.g.
``traces/a/records/rank=3/part-s00000-w0000001.parquet: not a Parquet file (truncated or
foreign file); delete it or re-run the capture``.
"""

from __future__ import annotations

from detfp_format.errors import DetfpError

__all__ = [
    "AnalysisError",
    "DetfpError",
    "DuplicateRankError",
    "EngineError",
    "ExpectationError",
    "IncomparableError",
    "IncompleteRunError",
    "ManifestError",
    "MissingRankError",
    "NotARunError",
    "OptionalDependencyError",
    "OutputError",
    "QueryError",
    "SchemaVersionError",
    "SelectionError",
    "ShardError",
    "TraceError",
]


class AnalysisError(DetfpError):
    """Base class of every error detfp_analyze raises on purpose (exit code 2 in the CLI)."""


class TraceError(AnalysisError):
    """A run directory or one of its files cannot be used."""


class NotARunError(TraceError):
    """The path is not a detfp run directory (missing, not a directory, no manifest)."""


class SchemaVersionError(TraceError):
    """A manifest or shard carries a schema or digest version this release cannot read."""


class ManifestError(TraceError):
    """A manifest is unreadable, not JSON, or lacks a required key."""


class MissingRankError(TraceError):
    """Ranks 0..world_size-1 are not all present (use --allow-missing-ranks to tolerate)."""


class DuplicateRankError(TraceError):
    """Two manifests or shards claim the same rank and segment."""


class ShardError(TraceError):
    """A shard is not Parquet, lacks columns, or its rank column disagrees with its partition."""


class IncompleteRunError(TraceError):
    """A run holds less than its commit logs promise (a missing or uncommitted shard, a launch that
    never closed or closed incomplete); use --allow-incomplete to analyze the steps held completely."""


class IncomparableError(AnalysisError):
    """Two runs differ in a way that makes a bitwise comparison meaningless (world size, layout, digest version)."""


class SelectionError(AnalysisError):
    """A rank/step selection or option names something the runs do not have (e.g. --ranks 9 of 8)."""


class ExpectationError(AnalysisError):
    """An expected-divergences file (``bisect --expect``) is missing, malformed or names an unknown field."""


class EngineError(AnalysisError):
    """The analysis engine (Apache Spark: ``--engine spark``) cannot start or failed: no Java, a bad
    ``--master`` or ``--conf``, executors that cannot read the runs."""


class QueryError(AnalysisError):
    """A SQL query failed; the message carries DuckDB's one-line reason."""


class OutputError(AnalysisError):
    """A file the user asked for (``--html``, ``plot --out``, ``export --perfetto``, ``sql -o``)
    cannot be written; the message names that output, never the trace."""


class OptionalDependencyError(AnalysisError, ImportError):
    """An optional dependency (matplotlib, ...) is missing; the message names the install command."""
