"""The Spark session's settings for a local master (no JVM: pure functions)."""

from __future__ import annotations

import os

import pytest

from detfp_analyze.spark.runtime import local_cores


@pytest.mark.parametrize(
    ("master", "cores"),
    [
        ("local", 1),
        ("local[2]", 2),
        ("local[16]", 16),
        ("local[4, 3]", 4),
        ("local[*]", os.cpu_count() or 1),
        ("local[*,2]", os.cpu_count() or 1),
        ("spark://head:7077", None),
        ("yarn", None),
        ("local-cluster[2,1,1024]", None),
        (None, None),
    ],
)
def test_local_cores_is_the_local_masters_core_count(master, cores):
    """A local master gets one shuffle partition per core (``session``), a cluster its own setting."""
    assert local_cores(master) == cores
