"""The one thing pyproject.toml cannot say: the optional native code of the capture.

``detfp_capture._digest._lanes`` (C, no dependency beyond Python's headers) computes the digest's
level GEMM exactly on CPUs without int8 dot-product instructions. It is optional: where it cannot
be built (no C compiler, no Python headers) the install goes on without it and the digest uses
torch's exact float32 GEMM, which gives the same bits (docs/capture.md, "Native kernel").

``detfp_capture._recorder._hostpath`` (C, the same conditions) holds the native record path: a
digest Slot the garbage collector does not track, the dispatch mode's per-op entries, the append
paths, digests taken at record time through the kernel's tree, a step boundary's batch and a
byte copy for staging snapshots (its parts in ``_recorder/hostpath_c/``, compiled as one unit).
Optional too: without it the record path runs in Python and writes the same trace
(docs/capture.md, "Host cost per record").
"""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "detfp_capture._digest._lanes",
            sources=["detfp_capture/_digest/_lanes.c"],
            # Its parts, #included by _lanes.c (one translation unit): a change rebuilds it.
            depends=sorted(str(p) for p in Path("detfp_capture/_digest/lanes_c").glob("*.c")),
            optional=True,
        ),
        Extension(
            "detfp_capture._recorder._hostpath",
            sources=["detfp_capture/_recorder/_hostpath.c"],
            # Its parts, #included by _hostpath.c (one translation unit): a change rebuilds it.
            depends=sorted(str(p) for p in Path("detfp_capture/_recorder/hostpath_c").glob("*.c")),
            optional=True,
        ),
    ]
)
