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
from detfp_capture.errors import ConfigError
from detfp_format.contract import DIGEST_VERSION

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
_STATE: list[Scheme] = [_initial()] * 2
#: Schemes of the ``use`` blocks entered and not left, innermost last.
_USED: list[Scheme] = []
#: Live holders (capture sessions) and the scheme each holds.
_HOLDERS: list[tuple[weakref.ref, Scheme]] = []


def _refresh(_ref: object = None) -> None:
    """The live holders' scheme (a capture's version governs all its digests), else the
    innermost ``use`` block's, else the default."""
    with _LOCK:
        _HOLDERS[:] = [(r, s) for r, s in _HOLDERS if r() is not None]
        _STATE[0] = _HOLDERS[0][1] if _HOLDERS else _USED[-1] if _USED else _STATE[1]


def _conflict(scheme: Scheme) -> Scheme | None:
    """A live holder's or an open ``use`` block's scheme other than ``scheme``, if any."""
    _refresh()
    return next((s for s in [*(s for _, s in _HOLDERS), *_USED] if s is not scheme), None)


def active() -> Scheme:
    """The scheme new digests use (read on every ``start``: one list index)."""
    return _STATE[0]


@contextlib.contextmanager
def use(version: int) -> Iterator[Scheme]:
    """New digests started inside use ``version`` (tests, benchmarks, ``fingerprint`` callers);
    DigestError while a live capture session holds another version (its digests must not change
    version under it)."""
    scheme = get(version)
    with _LOCK:
        _refresh()
        held = next((s for _, s in _HOLDERS if s is not scheme), None)
        if held is not None:
            raise DigestError(
                f"digest version {version} asked for while a capture session of this process uses version "
                f"{held.version}; pass version= to fingerprint/start instead"
            )
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
    ``release(owner)`` or until ``owner`` is garbage. DigestError if another live holder, or an
    open ``use`` block, has a different version."""
    scheme = get(version)
    with _LOCK:
        other = _conflict(scheme)
        if other is not None:
            raise DigestError(
                f"digest version {version} requested while another capture session of this process (or a "
                f"versions.use block) uses version {other.version}; close that session first or use the same version"
            )
        _HOLDERS.append((weakref.ref(owner, _refresh), scheme))
        _refresh()
    return scheme


def release(owner: object) -> None:
    """``owner`` no longer holds its version."""
    with _LOCK:
        _HOLDERS[:] = [(r, s) for r, s in _HOLDERS if r() is not owner]
        _refresh()
