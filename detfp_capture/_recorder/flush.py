"""What a flush makes of its records: resolved digests, then the records table's columns,
the ``pointer_like`` hazards the digests reveal, and the recompute check.

A mixin of the ``Recorder`` (``_state.py``), which holds the state named below; kept apart
because it runs once per flush window, off the per-record hot path.
"""

from __future__ import annotations

from detfp_capture._digest.batched import BATCHED
from detfp_capture._digest.resolve import resolve_raw, resolve_rows
from detfp_capture._recorder.deferred import Slot
from detfp_capture._recorder.records import RecordBuffer, record_columns

__all__ = ["FlushTables"]


class FlushTables:
    """Recorder methods that turn a flush window's records into its records table."""

    events: list[tuple]
    args_written: set[str]
    args_rows: dict[str, list] | None
    forward_outputs: dict[tuple, set[str]]
    recompute_checks: list[tuple]
    step: int

    # Also used from the recorder: next_seq().

    @staticmethod
    def _resolve(slots: list[Slot]) -> None:
        """Fill every slot's ``fp`` (a ``resolve_raw`` tuple). Rows of batches (most
        slots) are resolved in bulk; the rest, and any a failed device left, one by one."""
        rows: list[Slot] = []
        rest: list[Slot] = []
        for s in slots:
            (rows if s.pending is BATCHED and not s.arena_pointer else rest).append(s)
        if rows:
            for s, hexes in zip(rows, resolve_rows(rows), strict=True):
                if hexes is None:
                    rest.append(s)
                else:
                    s.fp = (hexes, None, None, None, False)
                    s.pending = None
        if rest:
            for s, fp in zip(rest, resolve_raw([s.started() for s in rest]), strict=True):
                s.fp = fp
                s.pending = None

    def _record_columns(self, records: RecordBuffer) -> dict[str, list]:
        """Columns of the records table, plus what the resolved digests say: pointer-like
        hazards (flag and event) and the recompute check's inputs."""
        cols, fps, ok, digests, texts = record_columns(records)
        # Each argument text once per segment (the args table), in the window it first appears.
        seen = self.args_written
        new = sorted((v[1], v[2], d, v[0]) for d, v in texts.items() if d not in seen)
        if new:
            seen.update(d for _, _, d, _ in new)
            self.args_rows = {
                "step": [r[0] for r in new],
                "seq": [r[1] for r in new],
                "args_digest": [r[2] for r in new],
                "text": [r[3] for r in new],
            }
        calls, roles, args = records.call, records.role, records.arg
        hazards: list = records.hazards
        fwd = self.forward_outputs
        check = self.recompute_checks
        for i, fp in enumerate(fps):
            if not ok[i]:
                continue
            c = calls[i]
            kind = c[4]
            if fp[4] and "pointer_like" not in hazards[i]:
                hazards[i] = (*hazards[i], "pointer_like")
                self.events.append(
                    (
                        c[0],
                        self.next_seq(),
                        "hazard",
                        "pointer_like",
                        c[3],
                        None,
                        f"{kind} {c[5]} {args[i]}: int64 values look like device pointers",
                    )
                )
            if kind == "module_output" and roles[i] == "output":
                if c[2] == "forward":
                    fwd.setdefault((c[0], c[1], c[3], args[i]), set()).add(digests[i])
                elif c[2] == "recompute":
                    check.append((c[0], c[1], c[3], c[5], args[i], digests[i]))
        cols["hazards"] = hazards
        self._check_recompute()
        return cols

    def _check_recompute(self) -> None:
        checks, self.recompute_checks = self.recompute_checks, []
        for step, mb, module, name, arg, d in checks:
            seen = self.forward_outputs.get((step, mb, module, arg))
            if seen is None:
                continue  # forward output not captured (selector, or a different step window)
            if d not in seen:
                self.events.append(
                    (
                        step,
                        self.next_seq(),
                        "recompute_mismatch",
                        name,
                        module,
                        None,
                        f"microbatch {mb} {arg}: recomputed output differs from the original forward output",
                    )
                )
        # Forward outputs of the current step may still be recomputed after the next flush.
        self.forward_outputs = {k: v for k, v in self.forward_outputs.items() if k[0] >= self.step}
