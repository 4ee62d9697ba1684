"""Runs on disk: open and validate a run directory, and what the shards hold.

* ``reader``: ``open_run``, the one opener: manifests, commit logs, shards and completeness in one
  order, with the run index (``runindex``) as its cache, to a ``Run`` (``run``) whose ``scan``
  reads a table lazily with files pruned by rank and step;
* ``manifests``, ``commit_logs``, ``shard_scan`` (with ``footer_bytes``, ``footer_head``,
  ``footer_contract``, ``committed_footers``): what the opener reads, one kind of file each;
* ``completeness``: the commit logs' promise against the shards on disk (``--allow-incomplete``);
  ``held_steps``: two opened runs limited to the steps both hold completely;
* ``integrity``: the rows bisect reads contradict no contract rule (seq order, unique keys, shapes);
* ``envdiff``: the manifests of two runs compared key by key, and which differences block a comparison.

Nothing here compares records: that is ``detfp_analyze.rule`` and the ``bisect`` pipeline.
"""
