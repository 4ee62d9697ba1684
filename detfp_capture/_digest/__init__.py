"""The digest: what turns a tensor into its 128-bit fingerprint (docs/digest.md).

- ``core``: the algorithm (weights, the level GEMMs, the finalizer, moments, the pointer check);
- ``pending``: ``start`` one tensor's digest on its device (``Pending``; small tensors in an arena);
- ``batched``: start many at once (step boundaries; deferred op-level batches); ``levels``: the
  further tree levels of such a batch, for all of its tensors at once;
- ``staging``: boundary tensors taken when recorded, digested later as one batch;
- ``resolve``: started digests to integers (one finalize and one device-to-host copy per device);
- ``results``: ``Fingerprint``, ``Moments``, ``DigestError``; ``stable``: process-independent text.

``detfp_capture.digest`` is the public API over this package.
"""
