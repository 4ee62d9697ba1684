"""The native record path's plain appends configured (``_hostpath.configure``), once.

``_hostpath.append_plain`` (and what calls it: ``append_fast``, ``record_op``, ``roots_fill``'s
record-time route) reads the Python objects it shares with ``hot.append_plain_py`` from this
configuration: the awaited marker, the tensor type and int64 (identity checks), the dtype and
shape caches, the staging class, the digest module, the version cache's limit and the empty
hazards tuple. ``configure`` is the first part of the native path's one configuration
(``seam.configure_native``); the objects the Python path compares against by identity live
here, below both paths.
"""

from __future__ import annotations

import functools

import torch

from detfp_capture import digest
from detfp_capture._digest.awaited import PLAIN
from detfp_capture._digest.staging import Staging
from detfp_capture._recorder.slot import DTYPE_STR, NATIVE, SHAPES, _hostpath, dtype_str, shape_tuple, storage_ptrs
from detfp_capture._recorder.vcache import LIMIT

__all__ = ["INT64", "NO_HAZARDS", "TENSOR", "configure"]

#: A record's hazards when it has none (one tuple, compared by identity in C and Python).
NO_HAZARDS: tuple[str, ...] = ()
INT64 = torch.int64
TENSOR = torch.Tensor


@functools.cache
def configure() -> None:
    """Hand the shared objects to the native record path, the first time only; nothing without it."""
    if NATIVE:
        _hostpath.configure(
            PLAIN, TENSOR, INT64, DTYPE_STR, dtype_str, SHAPES, shape_tuple, Staging, digest, storage_ptrs,
            NO_HAZARDS, LIMIT,
        )  # fmt: skip
