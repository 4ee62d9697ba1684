"""Verdicts: did this rank's first divergent record start the difference, or receive it?

Every verdict decision lives in this package: ``local`` (what the rank's own records say),
``peers`` (the group-wide and cross-rank tests), ``resolve`` (the stage: a final ``Verdict`` for
every record the walk found, always one of ``result.VERDICTS``). Over aligned records
(``records.Aligned``). A call is the set of records
sharing a call_hash on one rank and step: its inputs are written before it runs, its
outputs after, so the first divergent record of a rank is either

* on one side only or out of order -> ``structural`` (control flow differed);
* of a kind fed from outside the captured region (batch, rng_state, probe), or a parameter
  read by the first optimizer step of a segment -> ``source`` (data pipeline, restore, RNG);
* a record derived inside the step whose producer the capture did not see in full
  (``DERIVED_KINDS``: parameters, gradients and optimizer state), judged by what produced it:
  the optimizer step (its parameters and gradients matched: ``origin`` at the optimizer
  step, its hyperparameters are its arguments), the backward of the parameter's module (a
  gradient: ``origin`` there, or ``unobserved_producer`` when ops were captured), a write
  after the optimizer step (``unobserved_producer``), or the whole step's computation at
  level metrics. When that producer includes an uncaptured cross-rank reduction, the verdict
  waits for the cross-rank test (``reduction``, see ``cross_rank``);
* an input of a call -> ``unobserved_producer`` (no earlier record differs, so whatever
  wrote it was not captured; the call is the consumer to name), unless only the call's
  non-tensor arguments differ: then the call site changed them (``origin``, kind arguments);
  below level ops a submodule's input was made by its parent's own code, and a collective's
  input by the code of the module that launched it, which that level does not capture by
  design: ``origin`` there (or the cross-rank test on a multi-rank job: over the data-parallel
  group for what the optimizer reads and writes, over every rank for the forward and backward);
* an output whose call's inputs all matched -> ``origin``, except that collectives
  (collective, p2p, reduced_grad) need the group-wide test (``group_verdict``): an origin
  only if every rank of the group had matching inputs for the same call, otherwise
  ``receiver`` (a carrier of a difference that started on a peer).

A rank-step whose model the capture saw but whose batch it did not (the root module took no
tensors: ``local.batch_unseen``) claims no local start for a submodule's input or a step-end
parameter: a data difference looks the same there, so the verdict is ``unobserved_producer``
with ``depends_on`` naming the batch. A view or pure data-movement op cannot create a
difference: an "origin" there is reported
as ``unobserved_producer`` with a ``contradiction`` pointing one hop upstream. Each verdict
may carry ``depends_on``: one line on what the capture could not see and what to capture next.
"""

from __future__ import annotations

from detfp_analyze.bisect.verdict.local import (
    COLLECTIVE_KINDS,
    COPY_OPS,
    DERIVED_KINDS,
    VIEW_OPS,
    LocalVerdict,
    StepFacts,
    is_view_op,
    local_verdict,
)
from detfp_analyze.bisect.verdict.peers import GroupTest, cross_rank, group_of, group_verdict, p2p_receiver
from detfp_analyze.bisect.verdict.resolve import RankVerdicts, Verdict, resolve

__all__ = [
    "COLLECTIVE_KINDS",
    "COPY_OPS",
    "DERIVED_KINDS",
    "VIEW_OPS",
    "GroupTest",
    "LocalVerdict",
    "RankVerdicts",
    "StepFacts",
    "Verdict",
    "cross_rank",
    "group_of",
    "group_verdict",
    "is_view_op",
    "local_verdict",
    "p2p_receiver",
    "resolve",
]
