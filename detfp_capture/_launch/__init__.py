"""The launcher, ``python -m detfp_capture --out DIR -- train.py``: capture without code changes.

``cli`` parses the options (without importing torch) and runs the script under a ``Session``;
``mode`` is the launcher's part in that Session, through its extension point (``_extension``):
global module hooks, steps counted by the script's optimizer steps (``_sources.autosteps``), the
rank learned from the process group when no ``RANK`` names it; ``children`` follows the
processes the script starts (a framework's re-execution of the script runs through the launcher
too). The package sits on the capture's top floor, beside the Session (tests/unit/test_layers.py).
"""
