"""The CI gate over stored runs: expected divergences (``expectations``: ``bisect --expect``) and
re-recording a golden run (``golden``: ``detfp-analyze golden update``).

Named for what it is, the gate a CI job passes or fails, and apart from ``detfp_guards`` (the
reproducibility guards that run a function under capture, with torch): this one needs no torch.
"""
