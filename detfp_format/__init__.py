"""detfp_format: the trace format both sides share, and nothing else.

The capture (``detfp_capture``, in the training job) writes runs with it; the analysis
(``detfp_analyze``, offline, no torch) reads them with it. It imports neither package and never
torch (a test walks every module's imports), so it is the one layer both depend on:

* ``contract``: tables, columns, enums, capture levels, the run directory layout, call-site keys
  (standard library only);
* ``types``: the contract's column types rendered for pyarrow, polars, DuckDB and Spark;
* ``arrowschema``: the contract's tables as pyarrow schemas and their Parquet encodings;
* ``selectors``: the step/rank selector grammar (``3-5,9``, ``10-``, ``all``);
* ``commitlog``: the per-rank commit log (the record of what was written, and its checks);
* ``rollups``: per-window summaries written beside the shards and read instead of records;
* ``rundir``: creating, appending to and overwriting a run directory;
* ``writer``: the shard writer (a background thread writing Parquet windows and the commit log);
* ``errors``: ``DetfpError``, the root of every detfp package's errors; ``FormatError`` and its subclasses.

``docs/trace-format.md`` is the same contract in prose.
"""

from __future__ import annotations

from detfp_format.errors import DetfpError, FormatError, RunExistsError, SchemaError, SelectorError

__all__ = ["DetfpError", "FormatError", "RunExistsError", "SchemaError", "SelectorError"]
