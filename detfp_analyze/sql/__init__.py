"""DuckDB views over one or two detfp runs (docs/sql.md): ``connect``, ``query``.

The views live in the ``.sql`` files next to this module (``run.sql``, ``union_*.sql``,
``compare.sql``); ``views`` loads them, documents every column and confines file access.
The comparison views take their record equality from ``detfp_analyze.rule`` (rendered to SQL).
"""

from __future__ import annotations

from detfp_analyze.sql.views import ViewDoc, connect, query, two_run_views, view_docs

__all__ = ["ViewDoc", "connect", "query", "two_run_views", "view_docs"]
