"""Golden-trace gates: expected divergences (``gate``: ``bisect --expect``) and re-recording a
golden run (``golden``: ``detfp-analyze golden update``)."""
