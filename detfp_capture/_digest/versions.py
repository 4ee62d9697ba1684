"""Which digest version new digests use in this process, and the versions there are.

``SCHEMES`` maps each version of ``contract.DIGEST_VERSIONS`` to its ``Scheme``. ``active()`` is
the one ``start``, ``start_many`` and ``Staging`` take for new digests; everything started keeps
its scheme (an arena, a batch, a pending), so ``resolve`` finalizes each digest with the version
that started it. The process default is ``contract.DIGEST_VERSION`` unless the environment sets
``DETFP_DIGEST_VERSION`` (read once, at import: ``_config.choose_digest_version``); ``use``
changes it for a block, and a capture ``Session`` holds its version for its lifetime
(``hold``/``release``): two live sessions of one process cannot capture with different versions
(a trace's manifest names one version for all of its digests).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

from detfp_capture._config import choose_digest_version
from detfp_capture._digest.core import Scheme
from detfp_capture._digest.results import DigestError
from detfp_capture._digest.tlh1 import SCHEME as _V1
from detfp_capture._digest.tlh2 import SCHEME as _V2
from detfp_capture.contract import DIGEST_VERSION
from detfp_capture.errors import ConfigError

__all__ = ["SCHEMES", "active", "get", "hold", "release", "use"]

#: Every version this release computes: the keys of ``contract.DIGEST_VERSIONS`` (a test holds
#: the two to each other).
SCHEMES: dict[int, Scheme] = {s.version: s for s in (_V1, _V2)}


def get(version: object) -> Scheme:
    """The scheme of ``version``; DigestError naming the versions there are for anything else."""
    scheme = SCHEMES.get(version) if type(version) is int else None
    if scheme is None:
        known = ", ".join(map(str, sorted(SCHEMES)))
        raise DigestError(f"digest version {version!r} is unknown: this detfp computes versions {known}")
    return scheme


def _initial() -> Scheme:
    try:
        return SCHEMES[choose_digest_version()]
    except ConfigError:  # reported where it matters: Session() raises it; plain digests take the default
        return SCHEMES[DIGEST_VERSION]


_LOCK = threading.RLock()  # re-entrant: a holder's weakref callback may run inside a locked block
#: [the active scheme, the process default]; ``_refresh`` recomputes the first from the state below.
_STATE: list[Scheme] = [_initial(), _initial()]
#: Schemes of the ``use`` blocks entered and not left, innermost last.
_USED: list[Scheme] = []
#: Live holders (capture sessions) and the scheme each holds.
_HOLDERS: list[tuple[weakref.ref, Scheme]] = []


def _refresh(_ref: object = None) -> None:
    """The innermost ``use`` block's scheme, else the live holders', else the default."""
    with _LOCK:
        _HOLDERS[:] = [(r, s) for r, s in _HOLDERS if r() is not None]
        _STATE[0] = _USED[-1] if _USED else _HOLDERS[0][1] if _HOLDERS else _STATE[1]


def active() -> Scheme:
    """The scheme new digests use (read on every ``start``: one list index)."""
    return _STATE[0]


@contextlib.contextmanager
def use(version: int) -> Iterator[Scheme]:
    """New digests started inside use ``version`` (tests, benchmarks, ``fingerprint`` callers)."""
    scheme = get(version)
    with _LOCK:
        _USED.append(scheme)
        _refresh()
    try:
        yield scheme
    finally:
        with _LOCK:
            _USED.remove(scheme)
            _refresh()


def hold(owner: object, version: int) -> Scheme:
    """Make ``version`` the active one for as long as ``owner`` (a Session) holds it: until
    ``release(owner)`` or until ``owner`` is garbage. DigestError if another live holder holds a
    different version."""
    scheme = get(version)
    with _LOCK:
        _refresh()
        other = next((s for _, s in _HOLDERS if s is not scheme), None)
        if other is not None:
            raise DigestError(
                f"digest version {version} requested while another capture session of this process uses "
                f"version {other.version}; close that session first or use the same version"
            )
        _HOLDERS.append((weakref.ref(owner, _refresh), scheme))
        _refresh()
    return scheme


def release(owner: object) -> None:
    """``owner`` no longer holds its version."""
    with _LOCK:
        _HOLDERS[:] = [(r, s) for r, s in _HOLDERS if r() is not owner]
        _refresh()
