"""DuckDB views over one or two detfp runs: ``connect(a, b=None)``.

Pipeline: open and validate each run (``reader.open_run``) -> one private source view per
table (``_a_records_src``: ``read_parquet`` over exactly the run's validated shard list, the
rank column coming from the files, rows superseded by a later segment filtered out with the
reader's rule, an empty typed view when a table has no shard) -> the documented views of the
``.sql`` files next to this module (``run.sql`` per run, then ``union_*.sql``, then
``compare.sql`` and ``first_divergence.sql`` for two runs; their ``${...}`` fragments are the
comparison rule rendered to SQL from ``detfp_analyze.rule``, and bisect's scope of the pair
becomes private views, so ``first_divergence`` names the record ``bisect`` does). A run on another
file system (``Run.store``: ``s3://``, ``gs://``, ...) is read through a ``pyarrow.dataset``
registered with the connection instead of ``read_parquet`` (DuckDB's own object-store reader is an
extension it would download); same views, the ``shard`` column holds the file's URI. Everything stays lazy: DuckDB reads Parquet only when a query
runs, with projection and filter pushdown. Runs opened with ``allow_incomplete`` show only the
steps held completely (with two runs: the steps both hold completely, as bisect compares).

File access is confined (unless ``allow_file_access``): after the views are created, DuckDB may
open exactly the runs' shard files and nothing else (``allowed_paths``, external access off,
no spill directory, configuration locked), so user SQL cannot read ``/etc/passwd``, write a
file with ``COPY ... TO``, attach a database or load an extension; ``query`` also refuses
statements that write or attach (``COPY``, ``EXPORT``, ``ATTACH``, ``INSTALL``, ``LOAD``), since
DuckDB would let ``COPY`` overwrite one of the allowed shard files themselves.

The SQL files are the API. Each view has a header comment and an ``-- @column name doc`` line
per column it adds; connect() copies them into DuckDB (``COMMENT ON``), filling contract
columns from ``detfp_format.contract``, so ``duckdb_views()`` and ``duckdb_columns()``
document every view and column. Views prefixed ``_`` are private helpers: connect() creates them
in the schema ``detfp_private`` (``PRIVATE``) and qualifies every reference to them, so the
user's listings (``SHOW TABLES``, ``duckdb_views()`` of schema ``main``, not internal) hold the public
views only.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from string import Template

import duckdb
import pyarrow as pa

from detfp_analyze import rule
from detfp_analyze.bisect.scope import Scope, plan
from detfp_analyze.errors import QueryError
from detfp_analyze.io.held_steps import restrict_pair
from detfp_analyze.io.reader import Run, open_run
from detfp_analyze.rule.to_sql import qualified, suffixed, to_sql
from detfp_format import contract
from detfp_format.arrowschema import arrow_schema
from detfp_format.types import duckdb_type

__all__ = ["PRIVATE", "ViewDoc", "connect", "query", "two_run_views", "view_docs"]

#: The schema of the private helper views (names prefixed ``_``), out of the user's listing.
PRIVATE = "detfp_private"
#: An identifier that may name a private view (``_aligned``; not ``a._x`` or ``x_y``).
_PRIVATE_REF = re.compile(r"(?<![\w.])(_\w+)")

_SHARD_DOC = "Path of the Parquet shard the row was read from (provenance)."
_VIEW_RE = re.compile(r"CREATE\s+VIEW\s+(\w+)", re.IGNORECASE)


@dataclass(frozen=True)
class ViewDoc:
    """The documentation of one view, parsed from its ``.sql`` file."""

    #: View name (with ``${run}`` substituted).
    name: str
    #: Header comment, one paragraph.
    doc: str
    #: (column, doc) for the columns the file documents explicitly, in file order.
    columns: tuple[tuple[str, str], ...]
    #: The CREATE VIEW statement.
    sql: str


def _sql_text(name: str) -> str:
    # Next to this module (package data): importlib.resources trips over editable installs here.
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def _sql_list(values: Iterable[str]) -> str:
    return ", ".join(_lit(v) for v in values)


#: The columns a full join of A and B (aliases a and b) takes from whichever side has the record:
#: where it is, and the call-site key.
_JOINED_KEY = ("rank", "step", "key_hash", "call_hash", *contract.CALL_KEY_COLUMNS, "role", "arg")


def rule_fragments(dialect: str = "duckdb") -> dict[str, str]:
    """The ``${...}`` fragments of the comparison ``.sql`` files, rendered from ``detfp_analyze.rule``.

    ``match`` reads a join of aliases ``a`` and ``b``; ``value``, ``hazard`` and ``signature``
    read suffixed or one-run columns; ``joined_key`` the located key of such a join; the rest are the rule's vocabulary and column lists.
    """
    fam = rule.FAMILY
    sig = ", ".join(f"coalesce(CAST({to_sql(c, suffixed, dialect)} AS VARCHAR), '-')" for c in rule.SIGNATURE)
    return {
        "match": to_sql(rule.MATCH, qualified, dialect),
        "value": to_sql(rule.VALUE, suffixed, dialect),
        "hazard": to_sql(rule.HAZARD, suffixed, dialect),
        "unstarted": to_sql(rule.UNSTARTED, lambda col: f"j.{col.name}", dialect),
        "record_hazard": to_sql(rule.RECORD_HAZARD, suffixed, dialect),
        "signature": f"concat_ws(chr(31), {sig})",
        "family": ", ".join(fam),
        "family_on": " AND ".join(f"s.{c} = j.{c}" for c in fam),
        "family_on_ab": " AND ".join(f"a.{c} = b.{c}" for c in fam),
        "joined_key": ", ".join(f"coalesce(a.{c}, b.{c}) AS {c}" for c in _JOINED_KEY),
        "divergent": _sql_list(rule.DIVERGENT),
        "shiftable": _sql_list(rule.SHIFTABLE),
        "boundary_kinds": _sql_list(rule.BOUNDARY_KINDS),
        "start_kinds": _sql_list(rule.START_KINDS),
        **{s: s for s in rule.STATES},
    }


def view_docs(file: str, run: str = "a", dialect: str = "duckdb") -> tuple[ViewDoc, ...]:
    """Parse one ``.sql`` file of this package into its documented views (``${run}`` set to ``run``,
    the rule's fragments rendered for ``dialect``: see ``rule_fragments``).

    A statement ends with ``;`` at the end of a line; the comment lines right above its
    CREATE VIEW are its doc, ``-- @column name doc`` lines its column docs.
    """
    text = Template(_sql_text(file)).substitute(run=run, **rule_fragments(dialect))
    views = []
    for chunk in re.split(r";[ \t]*$", text, flags=re.MULTILINE):
        lines = chunk.strip("\n").splitlines()
        m = next((i for i, line in enumerate(lines) if _VIEW_RE.match(line.strip())), None)
        if m is None:
            continue
        # The doc is the contiguous comment block immediately above CREATE VIEW.
        k = m
        while k > 0 and lines[k - 1].startswith("--"):
            k -= 1
        doc_lines, cols = [], []
        for line in lines[k:m]:
            body = line[2:].strip()
            if body.startswith("@column"):
                _, col, *rest = body.split(None, 2)
                cols.append((col, rest[0] if rest else ""))
            elif body:
                doc_lines.append(body)
        view = _VIEW_RE.match(lines[m].strip()).group(1)  # type: ignore[union-attr]
        views.append(ViewDoc(view, " ".join(doc_lines), tuple(cols), "\n".join(lines[m:])))
    return tuple(views)


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _source_sql(run: Run, table: str, arrow: str | None = None) -> str:
    """SELECT of one table's rows: contract columns + shard, superseded rows and steps not held
    completely dropped. ``arrow``: the name of the run's table registered as a pyarrow dataset
    (``_register``: a run on another file system), read instead of ``read_parquet``."""
    cols = contract.columns(table)
    files = run.files(table)
    if not files:
        typed = ", ".join(f"CAST(NULL AS {duckdb_type(c.type)}) AS {c.name}" for c in cols)
        return f"SELECT {typed}, CAST(NULL AS VARCHAR) AS shard WHERE false"
    names = ", ".join(c.name for c in cols)
    if arrow is not None:
        sql = f"SELECT {names}, shard FROM {arrow}"
    else:
        paths = ", ".join(_lit(str(f)) for f in files)
        # hive_partitioning off: the rank column is in every file (the reader checked it equals the
        # rank=R partition), and a hive column would be inferred as BIGINT instead of INTEGER.
        sql = f"SELECT {names}, filename AS shard FROM read_parquet([{paths}], hive_partitioning = false, filename = true)"
    drop = " OR ".join(t for t in (_superseded(run), _excluded(run)) if t)
    return f"{sql} WHERE NOT ({drop})" if drop else sql


def _excluded(run: Run) -> str:
    """SQL predicate true on rows of steps the run is not held completely (mirrors Run.scan)."""
    terms = []
    for rank, lo, hi in run.exclusions():
        steps = f"step >= {lo}" if hi is None else f"step BETWEEN {lo} AND {hi}"
        terms.append(f"(rank = {rank} AND {steps})")
    return " OR ".join(terms)


def _superseded(run: Run) -> str:
    """SQL predicate true on rows a later segment captured again (mirrors Run.scan)."""
    by_cut: dict[tuple[int, int], list[int]] = {}
    for rank, segment, first_step in run.supersession():
        by_cut.setdefault((segment, first_step), []).append(rank)
    terms = []
    for (segment, first_step), ranks in sorted(by_cut.items()):
        in_ranks = ", ".join(str(r) for r in sorted(ranks))
        terms.append(f"(segment = {segment} AND step >= {first_step} AND rank IN ({in_ranks}))")
    return " OR ".join(terms)


def _table_docs(table: str) -> dict[str, str]:
    return {c.name: c.doc for c in contract.columns(table)} | {"shard": _SHARD_DOC}


def _contract_table(view: str) -> str | None:
    """The contract table a view is named after: records for records, a_records, _b_records_src."""
    base = view.lstrip("_").removesuffix("_src")
    for name in (base, base[2:] if base[1:2] == "_" else ""):
        if name in contract.TABLES:
            return name
    return None


class _Views:
    """Creates views on a connection and documents every column (COMMENT ON).

    A column's doc is, in order: the view's own ``@column`` line, the contract doc when the
    view is named after a contract table (``a_records``, ``records``, ...), or the doc the same
    column had in a view created earlier (derived views inherit their sources' docs).
    """

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {PRIVATE}")
        #: Private views created so far: references to them are qualified with their schema.
        self.private: set[str] = set()
        self.known: dict[str, str] = {}
        #: Views created and not yet documented, in creation order: (name, doc, explicit docs).
        self.pending: list[tuple[str, str, dict[str, str]]] = []

    def create(self, name: str, sql: str, doc: str, explicit: dict[str, str]) -> None:
        sql = _PRIVATE_REF.sub(lambda m: f"{PRIVATE}.{m[1]}" if m[1] in self.private else m[1], sql)
        if name.startswith("_"):
            sql = re.sub(rf"CREATE\s+VIEW\s+{name}\b", f"CREATE VIEW {PRIVATE}.{name}", sql, count=1)
            self.private.add(name)
        self.con.execute(sql)
        self.pending.append((name, doc, explicit))

    def qualified(self, name: str) -> str:
        return f"{PRIVATE}.{name}" if name in self.private else name

    def document(self) -> None:
        """COMMENT ON every view created since the last call and each of its columns. The columns
        come from the catalog in one query (a view's columns are fixed when it is created), not a
        DESCRIBE per view, which binds the view, and its sources, again."""
        if not self.pending:
            return
        con, names = self.con, [n for n, _, _ in self.pending]
        rows = con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database() "
            "AND schema_name IN (current_schema(), ?) AND list_contains(?, table_name) ORDER BY column_index",
            [PRIVATE, names],
        ).fetchall()
        columns: dict[str, list[str]] = {n: [] for n in names}
        for view, col in rows:
            columns[view].append(col)
        comments = []
        for name, doc, explicit in self.pending:  # creation order: derived views inherit docs
            table = _contract_table(name)
            seed = _table_docs(table) if table else {}
            comments.append(f"COMMENT ON VIEW {self.qualified(name)} IS {_lit(doc)}")
            for col in columns[name]:
                cdoc = explicit.get(col) or seed.get(col) or self.known.get(col, "")
                self.known.setdefault(col, cdoc)
                if cdoc:
                    comments.append(f"COMMENT ON COLUMN {self.qualified(name)}.{col} IS {_lit(cdoc)}")
        self.pending.clear()
        con.execute(";\n".join(comments))  # one round trip: connect() documents hundreds of columns

    def create_file(self, file: str, run: str) -> None:
        for v in view_docs(file, run):
            self.create(v.name, v.sql, v.doc, dict(v.columns))


def _as_run(x: str | os.PathLike[str] | Run, allow_missing_ranks: bool, allow_incomplete: bool) -> Run:
    if isinstance(x, Run):
        return x
    return open_run(x, allow_missing_ranks=allow_missing_ranks, allow_incomplete=allow_incomplete)


def _register(con: duckdb.DuckDBPyConnection, run: Run, tag: str, table: str) -> str | None:
    """For a run on another file system (``Run.store``), its table as a pyarrow dataset registered
    with DuckDB (read through pyarrow's file system: DuckDB's own readers of object stores are an
    extension it would download); its name, or None for a local run (``read_parquet``)."""
    if run.store is None or run.store.local or not run.files(table):
        return None
    name = f"_{tag}_{table}_arrow"
    # The shard column is the dataset's virtual partition column: each row's file URI, as filename
    # gives it for a local run.
    con.register(name, run.store.dataset(arrow_schema(table), [str(f) for f in run.files(table)], "shard"))
    return name


def _confine(con: duckdb.DuckDBPyConnection, runs: Iterable[Run]) -> None:
    """Let DuckDB open exactly the runs' shard files from now on, and lock that setting (remote
    runs' files are read by pyarrow, never by DuckDB: none of them is allowed)."""
    files = (f for run in runs for table in contract.TABLES for f in run.files(table))
    paths = sorted({str(f) for f in files if isinstance(f, Path)})
    con.execute(f"SET allowed_paths = [{', '.join(_lit(p) for p in paths)}]")
    # No spill directory: DuckDB allows writing into it, and it would be a directory outside the runs.
    con.execute("SET temp_directory = ''")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


#: The files of views that compare two runs.
_TWO_RUN_FILES = ("compare.sql", "first_divergence.sql")


def _values(column: str, sql_type: str, values: Iterable[int]) -> str:
    vals = sorted(set(values))
    if not vals:
        return f"SELECT CAST(NULL AS {sql_type}) AS {column} WHERE false"
    return f"SELECT CAST(x AS {sql_type}) AS {column} FROM (VALUES {', '.join(f'({v})' for v in vals)}) AS t(x)"


def _create_scope(views: _Views, scope: Scope) -> None:
    """Bisect's scope of the two runs as private views: first_divergence compares what bisect does."""
    lo, hi = scope.window if scope.window is not None else ("NULL", "NULL")
    views.create(
        "_scope_ranks",
        f"CREATE VIEW _scope_ranks AS {_values('rank', 'INTEGER', scope.ranks)}",
        "Private: the ranks bisect compares (in both runs, holding something).",
        {"rank": "A compared rank."},
    )
    views.create(
        "_scope_window",
        f"CREATE VIEW _scope_window AS SELECT CAST({lo} AS BIGINT) AS lo, CAST({hi} AS BIGINT) AS hi",
        "Private: the inclusive step window bisect compares (the steps both runs hold).",
        {"lo": "First compared step (null: none).", "hi": "Last compared step (null: none)."},
    )
    views.create(
        "_scope_boundary",
        f"CREATE VIEW _scope_boundary AS {_values('step', 'BIGINT', scope.boundary)}",
        "Private: resume boundary steps, where restored state is compared first.",
        {"step": "A boundary step."},
    )


def connect(
    a: str | os.PathLike[str] | Run,
    b: str | os.PathLike[str] | Run | None = None,
    *,
    allow_missing_ranks: bool = False,
    allow_incomplete: bool = False,
    allow_file_access: bool = False,
    database: str = ":memory:",
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the documented views over run ``a`` (and ``b``); see docs/sql.md.

    ``a``/``b`` are run directories or ``Run`` objects. Views of one run: ``a_records``,
    ``a_metrics``, ``a_events``, ``a_kernels``, ``a_dumps`` (and ``b_*``), unions ``records``,
    ``metrics``, ``events`` with a ``run`` column; with two runs also ``pairs``,
    ``first_divergence``, ``metric_pairs`` and ``step_summary``. ``allow_incomplete``: open runs
    that hold less than their commit logs promise; the views then hold only the steps both runs
    hold completely. ``allow_file_access``: let queries read and write other files (by default
    DuckDB may open the runs' shards and nothing else; see the module docstring). Raises the
    reader's typed errors for unusable runs.
    """
    runs = {"a": _as_run(a, allow_missing_ranks, allow_incomplete)}
    if b is not None:
        runs["b"] = _as_run(b, allow_missing_ranks, allow_incomplete)
        runs["a"], runs["b"], _ = restrict_pair(runs["a"], runs["b"])
    con = duckdb.connect(database)
    try:
        # Byte-stable output in the CLI: no progress bar. Inside Jupyter without ipywidgets DuckDB
        # refuses to change the setting at all (and draws no bar there anyway), so that error is moot.
        with contextlib.suppress(duckdb.Error):
            con.execute("SET enable_progress_bar = false")
        # Every view's creation and documentation binds it down to read_parquet: read each shard's
        # footer once per connection, not once per bind (the shards never change under a connection).
        con.execute("SET parquet_metadata_cache = true")
        views = _Views(con)
        for tag, run in runs.items():
            for table in contract.TABLES:
                arrow = _register(con, run, tag, table)
                views.create(
                    f"_{tag}_{table}_src",
                    f"CREATE VIEW _{tag}_{table}_src AS {_source_sql(run, table, arrow)}",
                    f"Private: rows of table {table} of run {tag} ({run.label}), superseded rows dropped.",
                    {},
                )
            views.create_file("run.sql", tag)
        views.create_file("union_ab.sql" if b is not None else "union_a.sql", "a")
        if b is not None:
            views.create_file("compare.sql", "a")
            _create_scope(views, plan(runs["a"], runs["b"]))
            views.create_file("first_divergence.sql", "a")
        views.document()
        if not allow_file_access:
            _confine(con, runs.values())
    except BaseException:
        con.close()
        raise
    return con


_MISSING_RE = re.compile(r"Table with name (\w+) does not exist", re.IGNORECASE)


def two_run_views() -> tuple[str, ...]:
    """Public views that exist only on a two-run connection (``b_*`` and the comparisons), sorted."""
    names = [v.name for f in _TWO_RUN_FILES for v in view_docs(f)] + [v.name for v in view_docs("run.sql", "b")]
    return tuple(sorted(n for n in names if not n.startswith("_")))


#: Statement types ``query`` refuses on a confined connection: they write files, attach databases or load code.
_WRITING = frozenset(("COPY", "EXPORT", "ATTACH", "DETACH", "INSTALL", "LOAD", "COPY_DATABASE"))


def query(con: duckdb.DuckDBPyConnection, sql: str) -> pa.Table:
    """Run ``sql`` on a connection from ``connect`` and return an Arrow table.

    A failing query raises QueryError carrying DuckDB's reason on one line. On a confined
    connection (``connect`` without ``allow_file_access``) statements that write files, attach
    databases or load extensions are refused before they run.
    """
    try:
        locked = con.execute("SELECT current_setting('enable_external_access')").fetchall()[0][0] is False
        if locked:
            for st in con.extract_statements(sql):
                kind = st.type.name
                if kind in _WRITING:
                    raise QueryError(
                        f"query refused: {kind} statements are not allowed, queries may only read the runs; "
                        "pass --allow-file-access (allow_file_access=True) to lift this"
                    )
        rel = con.sql(sql)
        if rel is None:  # a statement without a result (CREATE, SET, ...)
            return pa.table({})
        return rel.to_arrow_table()
    except duckdb.Error as exc:
        reason = " ".join(str(exc).split("\n\n")[0].split())
        missing = _MISSING_RE.search(reason)
        if missing and missing.group(1).lower() in two_run_views():
            raise QueryError(
                f"query failed: view {missing.group(1)} compares two runs and this connection has one; pass both "
                f'runs (detfp-analyze sql RUN_A RUN_B "QUERY", or connect(a, b)); views that need two runs: '
                f"{', '.join(two_run_views())}"
            ) from None
        raise QueryError(
            f"query failed: {reason}; list the views with: SHOW TABLES (docs/sql.md)"
        ) from None
