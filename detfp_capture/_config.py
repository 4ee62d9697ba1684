"""Capture options: parsing and validation of everything ``Session`` accepts (the options
themselves, names, defaults and help, are ``_options.CaptureOptions``).

The user-facing spellings (``steps="3-5,9"``, ``ranks="0,4-7"``, regexes for modules,
rows, moments and dumps) are turned into one frozen ``CaptureConfig`` up front, so a typo
fails at ``Session(...)`` with a ConfigError naming the option, the bad value and the fix,
instead of silently capturing nothing hours into a job. ``CaptureConfig.describe`` is the
JSON form stored in the manifest's ``capture`` object.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from detfp_capture._options import CaptureOptions
from detfp_capture.errors import ConfigError
from detfp_format.contract import CAPTURE_LEVELS, DIGEST_VERSION, DIGEST_VERSIONS
from detfp_format.errors import SelectorError
from detfp_format.selectors import Selector
from detfp_format.selectors import parse_selector as _parse_selector

__all__ = [
    "DIGEST_VERSION_ENV",
    "FLUSH_STEPS",
    "LEVELS",
    "LEVEL_CAPABILITIES",
    "Capabilities",
    "CaptureConfig",
    "Selector",
    "TensorOption",
    "choose_digest_version",
    "parse_selector",
]

#: The environment variable that sets the digest version of captures that do not pass one.
DIGEST_VERSION_ENV = "DETFP_DIGEST_VERSION"
#: Step ends per flush window, at most (``flush_steps``'s default). A window is committed at a
#: step end once it holds this many steps or ``flush_records`` records: what a killed job loses
#: is bounded in steps, and the window boundaries are a function of the job alone (a clock would
#: put them where the machine's speed did, and the trace's layout with them).
FLUSH_STEPS = 50


def choose_digest_version(value: Any = None) -> int:
    """The digest version a capture uses: ``value`` (a key of ``contract.DIGEST_VERSIONS``), or
    when None the environment's ``DETFP_DIGEST_VERSION``, or ``contract.DIGEST_VERSION``."""
    known = ", ".join(map(str, sorted(DIGEST_VERSIONS)))
    if value is None:
        text = os.environ.get(DIGEST_VERSION_ENV, "").strip()
        if not text:
            return DIGEST_VERSION
        if text.isdigit() and int(text) in DIGEST_VERSIONS:
            return int(text)
        raise ConfigError(f"{DIGEST_VERSION_ENV}={text!r}: not a digest version; set it to one of {known} or unset it")
    if type(value) is not int or value not in DIGEST_VERSIONS:
        raise ConfigError(
            f"digest_version={value!r}: not a digest version; pass one of {known} "
            f"({DIGEST_VERSION}, the default, unless comparing with runs captured with another)"
        )
    return value


@dataclass(frozen=True)
class Capabilities:
    """What a capture level turns on. Code asks for a capability by name, never for a level
    number, so a new level is one new row of ``LEVEL_CAPABILITIES``, not a renumbering.

    Every level also records metrics, the RNG states at step start, the parameters at step end
    and the root module's input (kind ``batch``): that is level ``metrics``, all fields False.
    """

    #: Every watched module's boundaries: inputs and outputs in forward, the gradients in
    #: backward, recompute (and the recompute check); without it only the root module is hooked.
    module_boundaries: bool = False
    #: The ``torch.distributed`` wrappers (collectives, point-to-point) and DDP's recording comm
    #: hook (``reduced_grad``): the job's communication and its gradient reduction.
    collectives: bool = False
    #: The optimizer's boundaries: params and grads before ``step()``, params and state after.
    optimizer: bool = False
    #: The false-root hazard tracker (``async_pending`` at the boundaries; at ``ops`` also
    #: ``uninitialized`` and ``nonblocking_pending``, which need every op).
    hazards: bool = False
    #: Every ATen op through the dispatch mode, and what comes with it: backward ops attributed
    #: to modules (autograd-node tags), kernel identities (``kernels=``), DDP's own work skipped.
    ops: bool = False

    @property
    def sees_writes(self) -> bool:
        """Every write goes through the dispatch mode: the version cache can be indexed by
        storage (a write through any alias drops what it staled), op digests can wait for a
        batch, and the step-end parameter records may reuse the optimizer step's digests."""
        return self.ops


#: Capture levels, cheapest first; each level records everything the previous one does.
LEVEL_CAPABILITIES: Mapping[str, Capabilities] = MappingProxyType(
    {
        "metrics": Capabilities(),
        "boundaries": Capabilities(module_boundaries=True, collectives=True, optimizer=True, hazards=True),
        "ops": Capabilities(module_boundaries=True, collectives=True, optimizer=True, hazards=True, ops=True),
    }
)
#: The level names, cheapest first (the contract's names: the manifest and the analysis use them).
LEVELS = tuple(LEVEL_CAPABILITIES)
assert LEVELS == CAPTURE_LEVELS, "a capture level is named in detfp_format.contract.CAPTURE_LEVELS first"


def parse_selector(value: Any, option: str) -> Selector | None:
    """Parse a step or rank selector (``detfp_format.selectors``' grammar); ConfigError if malformed."""
    try:
        return _parse_selector(value, option)
    except SelectorError as exc:
        raise ConfigError(str(exc)) from None


def _regex(value: Any, option: str) -> re.Pattern[str] | None:
    if value is None:
        return None
    if isinstance(value, re.Pattern):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{option}={value!r}: expected a regular expression string or None")
    try:
        return re.compile(value)
    except re.error as exc:
        raise ConfigError(f"{option}={value!r}: not a valid regular expression ({exc}); fix the pattern") from None


@dataclass(frozen=True)
class TensorOption:
    """An opt-in per record (rows, moments, dumps): off, on for all records, or on where a regex matches.

    The regex is searched in the record's name and in its module path.
    """

    #: Whether the option is on for every record.
    all: bool = False
    #: Records whose name or module matches get the option.
    pattern: re.Pattern[str] | None = None
    #: For rows: True (dim-0 rows) or an int chunk size in elements.
    arg: bool | int = True
    #: The user's spelling, for the manifest.
    text: Any = None

    @property
    def enabled(self) -> bool:
        return self.all or self.pattern is not None

    def wants(self, name: str, module: str) -> bool:
        if self.all:
            return True
        p = self.pattern
        return p is not None and (p.search(name) is not None or p.search(module) is not None)


def _tensor_option(value: Any, option: str, *, chunks: bool = False) -> TensorOption:
    if value is None or value is False:
        return TensorOption(text=value)
    if value is True:
        return TensorOption(all=True, text=True)
    if chunks and isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"{option}={value!r}: a chunk size must be a positive number of elements")
        return TensorOption(all=True, arg=value, text=value)
    if isinstance(value, str | re.Pattern):
        pat = _regex(value, option)
        return TensorOption(pattern=pat, text=pat.pattern if pat is not None else None)
    extra = ", an int chunk size" if chunks else ""
    raise ConfigError(f"{option}={value!r}: expected False, True{extra} or a regex of record names/modules")


@dataclass(frozen=True)
class CaptureConfig:
    """Validated capture options (``_options.CaptureOptions`` says what each means): the fields
    of ``CaptureOptions`` marked ``config``, no other."""

    #: One of LEVELS.
    level: str
    #: Steps to capture (None: all).
    steps: Selector | None = None
    #: Ranks that capture (None: all).
    ranks: Selector | None = None
    #: Module paths to capture at boundaries/ops (None: all).
    modules: re.Pattern[str] | None = None
    #: Row digests.
    rows: TensorOption = field(default_factory=TensorOption)
    #: Moments (sum, absmax, nan, inf).
    moments: TensorOption = field(default_factory=TensorOption)
    #: Raw-byte dumps.
    dumps: TensorOption = field(default_factory=TensorOption)
    #: Steps whose device kernels are recorded (None: none).
    kernels: Selector | None = None
    #: Fill tensors born from empty* with a per-run byte pattern.
    poison: bool = False
    #: Continue an existing run directory as a new segment.
    append: bool = False
    #: Flush (resolve digests, hand a window to the writer) every this many records.
    flush_records: int = 65536
    #: A step end also flushes once the window holds this many step ends (a count, never a
    #: clock: the windows are a function of the job, docs/capture.md "Flush windows").
    flush_steps: int = FLUSH_STEPS
    #: Digest the outputs of view and metadata-only ops too (default: counted, not digested).
    views: bool = False
    #: First step of this launch (manifest start_step); None when unknown.
    start_step: int | None = None
    #: Version of the digests (a key of ``contract.DIGEST_VERSIONS``; the manifest's
    #: ``digest_version``). Runs compare only with runs of the same version.
    digest_version: int = DIGEST_VERSION

    @property
    def caps(self) -> Capabilities:
        """What this level turns on."""
        return LEVEL_CAPABILITIES[self.level]

    def describe(self) -> dict[str, Any]:
        """JSON form for the manifest's ``capture`` object."""

        def sel(s: Selector | None) -> str | None:
            return None if s is None else s.text

        def opt(o: TensorOption) -> Any:
            if isinstance(o.text, re.Pattern):
                return o.text.pattern
            return o.text if o.text is not None else False

        return {
            "level": self.level,
            "steps": sel(self.steps),
            "ranks": sel(self.ranks),
            "modules": None if self.modules is None else self.modules.pattern,
            "rows": opt(self.rows),
            "moments": opt(self.moments),
            "dumps": opt(self.dumps) or None,
            "kernels": sel(self.kernels),
            "poison": self.poison,
            "append": self.append,
            "flush_records": self.flush_records,
            "flush_steps": self.flush_steps,
            "views": self.views,
        }


def make_config(opts: CaptureOptions) -> CaptureConfig:
    """Validate the user's options (``_options.CaptureOptions``, the fields marked ``config``);
    ConfigError names the option, the value and the fix."""
    level, flush_records, flush_steps, start_step = opts.level, opts.flush_records, opts.flush_steps, opts.start_step
    if level not in LEVELS:
        raise ConfigError(f"level={level!r}: unknown capture level; use one of {', '.join(map(repr, LEVELS))}")
    for name in ("poison", "append", "overwrite", "views"):
        if not isinstance(getattr(opts, name), bool):
            raise ConfigError(f"{name}={getattr(opts, name)!r}: expected True or False")
    if isinstance(flush_records, bool) or not isinstance(flush_records, int) or flush_records < 1:
        raise ConfigError(f"flush_records={flush_records!r}: expected a positive number of records per flush")
    flush_steps = FLUSH_STEPS if flush_steps is None else flush_steps
    if isinstance(flush_steps, bool) or not isinstance(flush_steps, int) or flush_steps < 1:
        raise ConfigError(f"flush_steps={flush_steps!r}: expected a positive number of steps per flush window")
    if start_step is not None and (isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0):
        raise ConfigError(f"start_step={start_step!r}: expected a non-negative step number")
    if opts.dumps is True:
        raise ConfigError(
            "dumps=True: dumping every tensor is never what you want; pass a regex of record names/modules"
        )
    return CaptureConfig(
        level=level,
        steps=parse_selector(opts.steps, "steps"),
        ranks=parse_selector(opts.ranks, "ranks"),
        modules=_regex(opts.modules, "modules"),
        rows=_tensor_option(opts.rows, "rows", chunks=True),
        moments=_tensor_option(opts.moments, "moments"),
        dumps=_tensor_option(opts.dumps, "dumps"),
        kernels=parse_selector(opts.kernels, "kernels") if opts.kernels is not None else None,
        poison=opts.poison,
        append=opts.append,
        flush_records=flush_records,
        flush_steps=flush_steps,
        views=opts.views,
        start_step=start_step,
        digest_version=choose_digest_version(opts.digest_version),
    )


def check_mapping(value: Any, option: str) -> dict[str, Any]:
    """``parallel`` and ``group_names`` must be dicts with string keys."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{option}={value!r}: expected a dict with string keys")
    return dict(value)
