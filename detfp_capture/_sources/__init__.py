"""Where records come from: each source observes one part of a training step and records
through the ``Recorder`` it finds in the ``CaptureContext`` it was given.

- ``modules``: module forward/backward/recompute boundaries (hooks), and the autograd-node tags
  that attribute backward ops to modules;
- ``dispatch`` (with ``ops``, the per-overload facts): every ATen op (level ops);
- ``collectives`` and ``ddp``: torch.distributed calls, DDP's gradient reduction;
- ``steps``: step begin/end and the optimizer's boundaries; ``kernels``: the profiler per op;
- ``launcher``: ``python -m detfp_capture`` (steps found from the script's optimizer);
- ``context``: what the sources share (the context object, the scope a record is made in).
"""
