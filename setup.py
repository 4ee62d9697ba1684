"""The one thing pyproject.toml cannot say: the optional native code of the capture.

``detfp_capture._digest._lanes`` (C, no dependency beyond Python's headers) computes the digest's
level GEMM exactly on CPUs without int8 dot-product instructions. It is optional: where it cannot
be built (no C compiler, no Python headers) the install goes on without it and the digest uses
torch's exact float32 GEMM, which gives the same bits (docs/capture.md, "Native kernel").

``detfp_capture._recorder._hostpath`` (C, the same conditions) holds the record path's helpers:
a digest Slot the garbage collector does not track, and a byte copy for staging snapshots.
Optional too: without it the record path runs in Python and writes the same trace
(docs/capture.md, "Host cost per record").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "detfp_capture._digest._lanes",
            sources=["detfp_capture/_digest/_lanes.c"],
            optional=True,
        ),
        Extension(
            "detfp_capture._recorder._hostpath",
            sources=["detfp_capture/_recorder/_hostpath.c"],
            optional=True,
        ),
    ]
)
