"""Result types of the detfp digest: Fingerprint, Moments, DigestError (re-exported by digest.py).

Kept apart from ``detfp_capture.digest`` (which builds them) so that the API module stays small;
docs/digest.md specifies what the fields mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from detfp_capture.errors import CaptureError

__all__ = ["DigestError", "Fingerprint", "Moments"]


class DigestError(CaptureError):
    """A digest was asked for with a bad argument, or an errored fingerprint's value was read."""


@dataclass(frozen=True)
class Moments:
    """Cheap magnitude statistics, computed on device in float64 (informative, not bitwise identity)."""

    #: float64 sum of the values (real part for complex; 0/1 for bool).
    sum: float
    #: float64 max |value| (modulus for complex); NaN when any value is NaN; 0.0 for empty tensors.
    absmax: float
    #: Number of NaN elements (0 for integer/bool dtypes).
    nan: int
    #: Number of +-Inf elements (0 for integer/bool dtypes).
    inf: int


_NO_COMPONENTS: Mapping[str, Fingerprint] = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class Fingerprint:
    """dtype, shape, numel and the 128-bit content digest of one tensor.

    Equality compares dtype, shape, numel, digest and components (rows and moments are derived
    views of the same contents and are not part of identity). A fingerprint with ``error`` set
    is never equal to anything, itself included.
    """

    #: torch dtype as str(), e.g. "torch.bfloat16".
    dtype: str
    #: Logical shape.
    shape: tuple[int, ...]
    #: Number of elements.
    numel: int
    #: 32 lowercase hex characters (hi 64 bits then lo 64 bits); "" when error is set.
    digest: str
    #: Ordered row (dim 0) or chunk digests when asked for, else None.
    rows: tuple[str, ...] | None = None
    #: Inner tensor name -> Fingerprint for flattened tensor subclasses; empty otherwise.
    components: Mapping[str, Fingerprint] = field(default_factory=lambda: _NO_COMPONENTS)
    #: Magnitude moments when asked for (None for subclasses: see components).
    moments: Moments | None = None
    #: Why the tensor could not be digested; None when the digest is valid.
    error: str | None = None
    #: For int64 tensors started with pointer_check=True: every value looks like a device pointer.
    pointer_like: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.components, MappingProxyType):  # always a read-only mapping
            object.__setattr__(self, "components", MappingProxyType(dict(self.components)))

    def __reduce__(self) -> tuple:
        # mappingproxy does not pickle: rebuild from a plain dict (wrapped again by __post_init__)
        comps = dict(self.components)
        args = (self.dtype, self.shape, self.numel, self.digest, self.rows, comps, self.moments, self.error)
        return (Fingerprint, (*args, self.pointer_like))

    @property
    def hi(self) -> int:
        """High 64 bits of the digest as an unsigned int."""
        return int(self._valid_digest()[:16], 16)

    @property
    def lo(self) -> int:
        """Low 64 bits of the digest as an unsigned int."""
        return int(self._valid_digest()[16:], 16)

    def _valid_digest(self) -> str:
        if self.error is not None:
            raise DigestError(f"fingerprint of a {self.dtype} tensor has no digest: {self.error}")
        return self.digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        if self.error is not None or other.error is not None:
            return False
        return (
            self.digest == other.digest
            and self.dtype == other.dtype
            and self.shape == other.shape
            and self.numel == other.numel
            and dict(self.components) == dict(other.components)
        )

    def __hash__(self) -> int:
        if self.error is not None:
            return id(self)
        return hash((self.dtype, self.shape, self.digest))


def _fingerprint_fast(
    dtype: str, shape: tuple[int, ...], numel: int, digest: str, rows: Any, moments: Any, ptr: bool
) -> Fingerprint:
    """Fingerprint(...) without the frozen dataclass's per-field object.__setattr__ calls.

    resolve builds one per record (tens of thousands per flush); this is 2-3x cheaper and a test
    checks it equals the regular constructor field by field.
    """
    f = _NEW(Fingerprint)
    f.__dict__.update(
        dtype=dtype,
        shape=shape,
        numel=numel,
        digest=digest,
        rows=rows,
        components=_NO_COMPONENTS,
        moments=moments,
        error=None,
        pointer_like=ptr,
    )
    return f


_NEW = object.__new__
