"""Types of the record path's native helpers (``_hostpath.c`` and its parts in ``hostpath_c/``).

Every name the extension exports, with the signature its C parses (METH_O and METH_FASTCALL
functions take positional arguments only); each one's Python twin is named. Objects the C only
passes back to Python (the Recorder, its staging, markers) are ``Any``, as they are in the twins.
``tests/unit/test_native_stubs.py`` holds this file to the built module's names."""

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from detfp_capture._recorder.call import Call, RecordSpec, TensorArg

class Slot:
    """``slot.PySlot``'s fields, not tracked by the cyclic collector (``slot._native_slot`` adds its methods)."""

    arena: Any
    arena_pointer: bool
    device: Any
    dtype: torch.dtype
    extra: Any
    hi: int | None
    lo: int | None
    numel: int
    opt_moments: bool
    opt_rows: bool | int
    pending: Any
    ref: Any
    row: int
    shape: tuple[int, ...]
    source: Any
    version: int | None
    def __init__(self, pending: Any, /) -> None: ...

def untracked_ref(t: torch.Tensor, /) -> weakref.ref[torch.Tensor]: ...
def copy_bytes(dst: int, src: int, n: int, /) -> None: ...
def configure(
    plain: Any, tensor: type, int64: torch.dtype, dtype_str: dict[torch.dtype, str], dtype_fn: Callable[..., str],
    shapes: dict[Any, tuple[int, ...]], shape_fn: Callable[..., tuple[int, ...]], staging: type, digest: Any,
    storage_ptrs: Callable[..., Any], no_hazards: Any, limit: int, /,
) -> None: ...
def append_plain(rec: Any, call: Call, tensors: list[TensorArg], fresh: bool, defer: bool, /) -> Any:
    """None when done; ``NotImplemented`` when the call is Python's (``hot.append_plain_py``)."""
def configure_op(
    parameter: type, has_subclass: Callable[[list[TensorArg]], bool], append_plain_py: Callable[..., None],
    defer_max: int, defer_bytes: int, /,
) -> None: ...
def configure_dispatch(out_names: Any, /) -> None: ...
def op_pre(mode: Any, func: Any, args: tuple, kwargs: dict, /) -> Any:
    """``CaptureMode._pre``'s tuple or None; ``NotImplemented`` where Python's must run."""
def op_post(mode: Any, pre: tuple, args: tuple, kwargs: dict, out: Any, /) -> Any:
    """None; ``NotImplemented`` where Python's ``CaptureMode._post`` must run."""
def configure_roots(
    tree_capsule: object, special_dtypes: Any, strided: Any, batched: Any, pool: Any, versions_state: Any,
    v2_scheme: Any, keys: torch.Tensor, nkeys: int, cpu: torch.device, /,
) -> None: ...
def roots_fill(
    tensors: Sequence[torch.Tensor], slots: Sequence[Any], held: Any, lanes_addr: int, first_row: int, /
) -> list[int]: ...
def batch_slots(rec: Any, specs: list[RecordSpec], fresh: bool, /) -> tuple[list[Any], list[torch.Tensor], list[Any]]: ...
def batch_records(rec: Any, specs: list[RecordSpec], slots: list[Any], /) -> list[Call]: ...
def configure_args(flat_marker: object, /) -> None: ...
def args_key(src: Any, /) -> tuple | None: ...
def root_stats() -> tuple[int, int, float]: ...
def rows_plan(items: Sequence[Any], meta_words: Callable[..., tuple[int, int]], /) -> list[tuple]: ...
def scatter(his: list, los: list, order: list[int], words: list[int], /) -> None: ...
def split_rows(slots: list[Any], batched: object, /) -> tuple[list[Any], list[Any]]: ...
def assign_rows(rows: list[Any], his: list[int | None], los: list[int | None], /) -> list[Any]: ...
def by_identity(items: list, /) -> tuple[list, list[int], list[int]]: ...
def configure_gather(arg_names: Any, flat_marker: object, open_marker: object, close_marker: object, /) -> None: ...
def gather(
    args: tuple, kwargs: dict, dest_pos: frozenset = ..., dest_kw: frozenset = ..., /
) -> tuple[list[TensorArg], tuple | None]: ...
def append_fast(rec: Any, call: Call, tensors: list[TensorArg], digest_it: bool, fresh: bool, defer: bool, /) -> None: ...
def record_op(
    rec: Any, name: str, module: str, phase: str, tensors: list[TensorArg], args_src: tuple | None, digest_it: bool,
    defer: bool, /,
) -> Call: ...
def record_plain(
    rec: Any, kind: str, name: str, module: str, phase: str, tensors: list[TensorArg], compiled: bool, fresh: bool, /
) -> Call:
    """``Recorder.record_call``'s plain case (no arguments, hazards, rows or deferred digest)."""
