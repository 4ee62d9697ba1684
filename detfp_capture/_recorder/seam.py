"""The record path's one seam: the methods a Recorder records through, in Python or in C.

The record path exists twice: the Python functions (``hot``, ``args``, ``records``, ``flush``,
``roots``) and their statement-for-statement C twins (``_hostpath`` and ``hostpath_c/``, which
write the same trace: ``tests/golden/test_capture_routes.py``). A ``Recorder`` holds one
``RecordPath`` (its ``path``), and every caller on the hot path goes through it: the dispatch
mode's op entries, the appends, the argument gathering and keys, the record-time digests, the
flush's resolution and grouping. Nothing is chosen by rebinding a module's names or by import
order; the native implementation is configured once, by one explicit call
(``configure_native``: the Python objects the C shares with its twins), when the first
``NativePath`` is made.

``record_path()`` is the default: native where ``_hostpath`` is built and ``DETFP_NATIVE`` is not
``0``. Tests build the path they want (``record_path(native=False)``, or a native path with some
pieces in Python: ``NativePath(python={Piece.APPENDS})``) and hand it to the Recorder
(``Recorder(..., path=...)``), or to the Recorders a Session makes (``recording_through``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from detfp_capture._recorder import args, flush, hostconfig, hot, records, roots
from detfp_capture._recorder.call import Call, RecordSpec, TensorArg
from detfp_capture._recorder.deferred import DEFER_BYTES, DEFER_MAX
from detfp_capture._recorder.slot import NATIVE, Slot, _hostpath
from detfp_capture._recorder.subclass import has_subclass
from detfp_capture.errors import ConfigError

__all__ = [
    "NativePath", "Piece", "PythonPath", "RecordPath", "configure_native", "record_path", "recording_through",
]  # fmt: skip


class Piece(enum.Enum):
    """The parts of the record path a native path can leave to Python (a test names the
    piece that differs)."""

    #: The dispatch mode's op entries (``op_pre``/``op_post``; Python: ``CaptureMode._pre``/``_post``).
    DISPATCH = "dispatch"
    #: ``gather``, ``record_op``, ``record_plain``, ``append_fast``, ``append_plain``, ``append_batch`` (the native
    #: op entries call the native appends, so this piece takes ``DISPATCH`` with it).
    APPENDS = "appends"
    #: The digests taken at record time (``roots_fill``; Python: none, the batch or staging route).
    ROOTS = "roots"
    #: The flush's resolution of batched rows (``split_rows``, ``rows_plan``, ``scatter``, ``assign_rows``).
    RESOLVE = "resolve"
    #: The flush's grouping of records by call (``by_identity``) and the argument memo's key (``args_key``).
    COLUMNS = "columns"


class RecordPath(Protocol):
    """What the Recorder and the dispatch mode call, in one implementation or the other."""

    @property
    def native(self) -> bool:
        """Whether any piece runs in C (the Slot class is ``slot.Slot`` either way)."""

    @property
    def op_pre(self) -> Callable[[Any, Any, tuple, dict], Any] | None:
        """``CaptureMode._pre`` for plain ops (NotImplemented: Python's runs); None: always Python's."""

    @property
    def op_post(self) -> Callable[[Any, tuple, tuple, dict, Any], Any] | None:
        """``CaptureMode._post`` for plain ops (NotImplemented: Python's runs); None: always Python's."""

    @property
    def roots(self) -> Any:
        """The record-time digests' ``roots_fill`` (``roots.start_roots``); None: not taken."""

    def gather(
        self, args: tuple, kwargs: dict, dest_pos: frozenset = ..., dest_kw: frozenset = ...
    ) -> tuple[list[TensorArg], tuple | None]: ...

    def record_op(
        self, rec: Any, name: str, module: str, phase: str, tensors: list[TensorArg], args_src: tuple | None,
        digest_it: bool, defer: bool,
    ) -> Call: ...  # fmt: skip

    def record_plain(
        self, rec: Any, kind: str, name: str, module: str, phase: str, tensors: list[TensorArg], compiled: bool,
        fresh: bool,
    ) -> Call: ...  # fmt: skip

    def append_fast(
        self, rec: Any, call: Call, tensors: list[TensorArg], digest_it: bool, fresh: bool, defer: bool
    ) -> None: ...

    def append_plain(self, rec: Any, call: Call, tensors: list[TensorArg], fresh: bool, defer: bool) -> None: ...

    def append_batch(self, rec: Any, specs: list[RecordSpec], fresh: bool) -> list[Call]: ...

    def args_key(self, src: tuple) -> tuple | None: ...

    def by_identity(self, items: list) -> tuple[list, list[int], list[int]]: ...

    def resolve_rows(self, slots: list[Slot]) -> list[Slot]: ...


class PythonPath:
    """The pure-Python record path (``DETFP_NATIVE=0``, or no C compiler at install)."""

    native = False
    op_pre = None
    op_post = None
    roots = None
    # Plain functions as class attributes (staticmethod): a lookup on the instance returns the
    # function itself, no bound method per call on the per-op path.
    gather = staticmethod(args.gather)
    record_op = staticmethod(hot.record_op_py)
    record_plain = staticmethod(hot.record_plain_py)
    append_fast = staticmethod(hot.append_fast_py)
    append_plain = staticmethod(hot.append_plain_py)
    append_batch = staticmethod(hot.append_batch_py)
    args_key = staticmethod(args.args_key)
    by_identity = staticmethod(records.by_identity)
    resolve_rows = staticmethod(flush.resolve_rows_py)


@functools.cache
def configure_native() -> Any:
    """Hand the C twins the Python objects they share with the Python path (the one
    configuration of ``_hostpath``, the first time only) and return the record-time digests'
    ``roots_fill`` (None without the digest kernel). Raises ``ConfigError`` where the record
    path's helpers are not built or are off (``DETFP_NATIVE=0``)."""
    if not NATIVE:
        raise ConfigError(
            "the native record path is not built or is off (DETFP_NATIVE=0): run scripts/bootstrap.sh, "
            "or use record_path(native=False)"
        )
    hostconfig.configure()
    _hostpath.configure_op(torch.nn.Parameter, has_subclass, hot.append_plain_py, DEFER_MAX, DEFER_BYTES)
    _hostpath.configure_args(args.markers()[0])
    _hostpath.configure_gather(args.ARG_NAMES, *args.markers())
    _hostpath.configure_dispatch(args.OUT_NAMES)
    return roots.configure_roots()


class NativePath:
    """The record path in C where it is built (``_hostpath``), each piece the C twin of
    ``PythonPath``'s; ``python``: pieces left to Python (tests, to name the piece that differs)."""

    native = True

    def __init__(self, python: Collection[Piece] = ()) -> None:
        py = frozenset(python)
        unknown = [p for p in py if not isinstance(p, Piece)]
        if unknown:
            raise ValueError(f"not pieces of the record path: {unknown!r} (seam.Piece: {[p.name for p in Piece]})")
        fill_roots = configure_native()
        appends = Piece.APPENDS not in py
        c = _hostpath
        dispatch = appends and Piece.DISPATCH not in py  # the C op entries call the C appends
        self.op_pre: Any = c.op_pre if dispatch else None
        self.op_post: Any = c.op_post if dispatch else None
        self.roots: Any = None if Piece.ROOTS in py else fill_roots
        self.gather: Any = c.gather if appends else args.gather
        self.record_op: Any = c.record_op if appends else hot.record_op_py
        self.record_plain: Any = c.record_plain if appends else hot.record_plain_py
        self.append_fast: Any = c.append_fast if appends else hot.append_fast_py
        self.append_plain: Any = hot.append_plain_native if appends else hot.append_plain_py
        self.append_batch: Any = hot.append_batch_native if appends else hot.append_batch_py
        columns = Piece.COLUMNS not in py
        self.args_key: Any = c.args_key if columns else args.args_key
        self.by_identity: Any = c.by_identity if columns else records.by_identity
        self.resolve_rows: Any = flush.resolve_rows_native if Piece.RESOLVE not in py else flush.resolve_rows_py


#: Paths given by ``recording_through`` (innermost last): what ``record_path()`` returns inside.
_GIVEN: list[RecordPath] = []


def record_path(native: bool | None = None) -> RecordPath:
    """The record path: native where built and on (``native`` None: the path given by an enclosing
    ``recording_through``, else ``slot.NATIVE``), else Python. ``native=True`` where it is not
    built raises ``ConfigError``."""
    if native is None:
        if _GIVEN:
            return _GIVEN[-1]
        native = NATIVE
    return NativePath() if native else PythonPath()


@contextlib.contextmanager
def recording_through(path: RecordPath) -> Iterator[RecordPath]:
    """Recorders made inside without a path of their own (a ``Session``'s) record through
    ``path``: a whole capture on the path a test wants, with no module patched."""
    _GIVEN.append(path)
    try:
        yield path
    finally:
        _GIVEN.pop()


if TYPE_CHECKING:  # both implementations are checked against the interface
    _PYTHON: RecordPath = PythonPath()
    _NATIVE: RecordPath = NativePath()
