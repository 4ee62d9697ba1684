"""The digest: what turns a tensor into its 128-bit fingerprint (docs/digest.md).

- ``core``: the tree every version shares (bytes, levels, metadata words, the mixer) and
  ``Scheme``, what a version provides; ``tlh1``, ``tlh2``: the two versions (level function,
  finalizer); ``versions``: which one new digests use; ``gemm``: torch's exact int8 GEMM routes;
  ``native``: the optional C kernels (``_lanes.c``); ``moments``: moments and the pointer check;
- ``pending``: ``start`` one tensor's digest on its device (``Pending``; small tensors in an arena);
- ``batched``: start many at once (step boundaries; deferred op-level batches); ``levels``: the
  further tree levels of such a batch, for all of its tensors at once;
- ``staging``: boundary tensors taken when recorded, digested later as one batch;
- ``resolve``: started digests to integers (one finalize and one device-to-host copy per device);
- ``results``: ``Fingerprint``, ``Moments``, ``DigestError``; ``stable``: process-independent text.

``detfp_capture.digest`` is the public API over this package.
"""
