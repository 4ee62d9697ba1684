"""The detfp tensor digest, "detfp-tlh128" (tree linear hash, 128 bits): the public API.

Pipeline for one tensor (all on the tensor's own device, no host sync until ``resolve``):

1. the logical contents, row-major, viewed as signed bytes (int8);
2. levels: zero-pad to a multiple of 1024 bytes, multiply the (M, 1024) byte matrix by a fixed
   per-level int8 matrix (1024 x 16) with exact int32 accumulation (``torch._int_mm``, or an exact
   float32 GEMM where that kernel is missing), take the int32 output's bytes as the next level's
   input, until one row of 16 lanes is left;
3. finalize the 16 lanes with a 128-bit meta word (algorithm, version, dtype, byte length, numel,
   shape) through a multiply-xorshift mixer, vectorized over a whole batch.

Capture calls ``start`` on every tensor of every op, so small tensors (<= 1024 bytes, one level)
are copied into a per-device arena by a single copy and hashed together by one GEMM at
``resolve``; ``resolve`` finalizes a batch and makes one device-to-host copy per device. Integer
arithmetic makes the result identical on every device. The implementation is the
``detfp_capture._digest`` package (``core``: the algorithm; ``pending``: ``start`` and the arena;
``resolve``; ``results``: the types below); the specification is docs/digest.md.
"""

from __future__ import annotations

from detfp_capture._digest.pending import Pending, fingerprint, start
from detfp_capture._digest.resolve import resolve
from detfp_capture._digest.results import DigestError, Fingerprint, Moments

__all__ = ["DigestError", "Fingerprint", "Moments", "Pending", "fingerprint", "resolve", "start"]
