"""The one thing pyproject.toml cannot say: the optional native kernel of the digest.

``detfp_capture._digest._lanes`` (C, no dependency beyond Python's headers) computes the digest's
level GEMM exactly on CPUs without int8 dot-product instructions. It is optional: where it cannot
be built (no C compiler, no Python headers) the install goes on without it and the digest uses
torch's exact float32 GEMM, which gives the same bits (docs/capture.md, "Native kernel").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "detfp_capture._digest._lanes",
            sources=["detfp_capture/_digest/_lanes.c"],
            optional=True,
        )
    ]
)
