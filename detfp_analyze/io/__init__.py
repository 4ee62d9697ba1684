"""Runs on disk: open and validate a run directory, and what the shards hold.

* ``reader``: ``open_run`` validates a run (manifests, shard footers, commit logs) and returns a
  ``Run`` whose ``scan`` reads a table lazily with files pruned by rank and step;
* ``footers``: the Parquet footers of every shard (magic, schema, row counts, step ranges);
* ``completeness``: the commit logs' promise against the shards on disk (``--allow-incomplete``);
* ``integrity``: the rows bisect reads contradict no contract rule (seq order, unique keys, shapes);
* ``envdiff``: the manifests of two runs compared key by key, and which differences block a comparison.

Nothing here compares records: that is ``detfp_analyze.rule`` and the ``bisect`` pipeline.
"""
