"""Rendering: a ``BisectResult`` (and, for pictures, the runs' records) into text, pictures and pages.

Compute and draw are separate: ``frames`` and ``layout`` return polars frames, ``draw`` and
``heatmap`` draw frames (matplotlib, optional), ``gallery`` bundles the figures of one result.
``report`` prints the text report, ``html`` the self-contained page, ``perfetto`` the timeline,
``recipes`` the commands to reproduce and recapture. Only the CLI writes files or prints.
Record equality comes from ``detfp_analyze.rule``; verdicts and patterns from
``detfp_analyze.bisect.result`` (an unknown one fails loudly, never draws as something else).
"""
