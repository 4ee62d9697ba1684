"""Single-run tools: what one run holds and whether it can be trusted, before any comparison.

* ``summary``: ranks, steps, levels, tables and counts of one run (``detfp-analyze summary``);
* ``certify``: single-run invariants: hazards, pending collectives, digest errors, replica
  splits, completeness (``detfp-analyze certify``);
* ``replicas``: data-parallel replicas whose parameters should be equal but are not (for ``certify``).
"""
