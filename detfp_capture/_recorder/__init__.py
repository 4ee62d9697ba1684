"""The recorder: one rank's record stream, from a recorded call to a window handed to the writer.

- ``recorder``: the ``Recorder`` (step/phase context, ``record_call`` and friends, ``flush``);
- ``slot``: the ``Slot`` each record's digest goes through; ``vcache``: the version cache;
- ``deferred``: digests waiting for a batch (level ops) and the staging hand-off;
- ``hazards``: false-root hazard state and flags;
- ``records`` and ``args``: the buffered records and their call tuples, op arguments;
- ``flush`` and ``columns``: resolved digests to the tables' columns.
"""
