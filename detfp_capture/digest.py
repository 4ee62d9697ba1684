"""The detfp tensor digest, "detfp-tlh128" (tree linear hash, 128 bits): the public API.

Pipeline for one tensor (all on the tensor's own device, no host sync until ``resolve``):

1. the logical contents, row-major, as bytes;
2. levels: zero-pad to a multiple of 1024 bytes, reduce each 1024-byte row with the level's
   function, take the outputs' bytes as the next level's input, until one row is left. Version 2
   (the default): two 64-bit multilinear sums of the row's 32-bit words with per-level keys
   (the native CPU kernel near memory bandwidth, or one exact int8 GEMM in torch on any
   device); version 1 (kept to compare old runs): an int8 GEMM with 16 int32 lanes;
3. finalize the root row with a 128-bit meta word (algorithm, version, dtype, byte length,
   numel, shape) through a multiply-xorshift mixer, vectorized over a whole batch.

Capture calls ``start`` on every tensor of every op, so small tensors (<= 1024 bytes, one level)
are copied into a per-device arena by a single copy and hashed together at ``resolve``;
``resolve`` finalizes a batch and makes one device-to-host copy per device. Integer arithmetic
makes the result identical on every device and route. ``version=`` picks a version per call;
otherwise the process's (``DETFP_DIGEST_VERSION``, or the capture Session's). The implementation
is the ``detfp_capture._digest`` package; the specification is docs/digest.md.
"""

from __future__ import annotations

from detfp_capture._digest.pending import Pending, fingerprint, start
from detfp_capture._digest.resolve import resolve
from detfp_capture._digest.results import DigestError, Fingerprint, Moments

__all__ = ["DigestError", "Fingerprint", "Moments", "Pending", "fingerprint", "resolve", "start"]
