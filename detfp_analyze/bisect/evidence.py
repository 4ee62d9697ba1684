"""Evidence fetched for the few records a report names, plus the discriminator view.

Every function reads only what it needs with filters pushed into the Parquet scan: the
peers' inputs of a collective call (the group-wide test), the detail columns of divergent
records (moments, row digests, argument digests, errors), their dumps, the kernels under
their calls, and every instance of the origin op in the origin ranks' divergent step.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect import align as _align
from detfp_analyze.bisect.discriminator import Discriminator, DiscriminatorRow
from detfp_analyze.bisect.reads import collect, collect_pair
from detfp_analyze.bisect.records import CallKey, Found, RecordKey
from detfp_analyze.bisect.result import Diagnosis, RankResult
from detfp_analyze.bisect.vocab import Level
from detfp_analyze.io.reader import Run
from detfp_analyze.rule.to_polars import names_for, to_polars
from detfp_format.contract import INPUTLESS_KINDS

__all__ = [
    "PEER_COLUMNS",
    "Evidence",
    "all_groups",
    "arg_texts",
    "asked",
    "discriminator",
    "dumps",
    "gather",
    "groups_of",
    "kernels",
    "peer_inputs",
]

#: ``rule.MATCH`` on a join of run A's columns with run B's (suffix ``_b``).
_MATCH = to_polars(rule.MATCH, names_for("", "_b"))
#: Origin ranks the discriminator view looks at.
DISCRIMINATOR_RANKS = 8


def all_groups(run: Run) -> dict[str, list[int]]:
    """Every logical group any rank's latest manifest names (first definition wins, by rank)."""
    groups: dict[str, list[int]] = {}
    for r in sorted(run.manifests):
        segs = run.manifests[r]
        if segs:
            for k, v in (segs[-1].get("groups") or {}).items():
                groups.setdefault(k, list(v))
    return groups


def groups_of(run: Run, rank: int, every: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Groups as ``rank`` sees them: its own manifest first, then any rank's."""
    groups = dict(every)
    own = run.manifests.get(rank)
    if own:
        groups.update({k: list(v) for k, v in (own[-1].get("groups") or {}).items()})
    return groups


#: The records columns the group-wide test reads of the peers' input records (every engine's).
PEER_COLUMNS = ("rank", "step", "call_hash", "key_hash", "role", "status", "digest_hi", "digest_lo", "args_digest")


def asked(
    run_a: Any, run_b: Any, asks: Sequence[tuple[int, int, int, tuple[int, ...]]]
) -> tuple[list[int], list[int], list[int]]:
    """What the group-wide test reads for ``asks`` (asking rank, step, call_hash, group peers):
    the asked peers both runs hold, the steps and the call hashes, each sorted. Every engine's
    ``peer_inputs`` reads these (peers x steps, those calls' input records)."""
    have = set(run_a.ranks) & set(run_b.ranks)
    peers = sorted(p for p in set().union(*(g for *_, g in asks)) if p in have)
    return peers, sorted({s for _, s, _, _ in asks}), sorted({h for _, _, h, _ in asks})


def peer_inputs(run_a: Run, run_b: Run, asks: Sequence[tuple[int, int, int, tuple[int, ...]]]) -> dict[CallKey, str]:
    """(peer, step, call_hash) -> ``rule.DIFFERS`` when an input of that call on the peer diverges
    (``rule.MATCH``), ``rule.SAME`` otherwise; calls the peer does not hold are absent."""
    sel, steps, hashes = asked(run_a, run_b, asks)
    cols = list(PEER_COLUMNS)

    def side(run: Run) -> pl.LazyFrame:
        if not sel:
            return pl.LazyFrame(schema={c: pl.String if c in ("role", "status") else pl.Int64 for c in cols})
        lf = run.scan("records", ranks=sel, steps=steps)
        return lf.filter(pl.col("call_hash").is_in(hashes) & (pl.col("role") == "input")).select(cols)

    a, b = collect_pair(side(run_a), side(run_b))
    out: dict[CallKey, str] = {}
    if a.height or b.height:
        j = a.join(b.drop("role"), on=["rank", "step", "call_hash", "key_hash"], how="full", coalesce=True, suffix="_b")
        # An input without evidence on a side (skipped, a digest error) is no evidence either way,
        # as in the rank's own call: only a divergent match makes the peer's inputs differ.
        differs = _MATCH.is_in(rule.DIVERGENT)
        g = j.group_by("rank", "step", "call_hash").agg(differs.any().alias("d"))
        for rank, step, h, d in g.iter_rows():
            out[CallKey(int(rank), int(step), int(h))] = rule.DIFFERS if d else rule.SAME
    return out


def dumps(run: Run, keys: Collection[RecordKey]) -> dict[RecordKey, bytes]:
    """RecordKey -> the record's dumped bytes, for the ``keys`` the run dumped."""
    if not keys or "dumps" not in run.tables:
        return {}
    key = pl.DataFrame(
        {"rank": [k[0] for k in keys], "step": [k[1] for k in keys], "key_hash": [k[2] for k in keys]},
        schema={"rank": pl.Int32, "step": pl.Int64, "key_hash": pl.UInt64},
    )
    lf = run.scan("dumps", ranks=sorted({k[0] for k in keys}), steps=sorted({k[1] for k in keys}))
    lf = lf.filter(pl.col("key_hash").is_in(key["key_hash"].unique().to_list()))
    df = collect(
        lf.select("rank", "step", "key_hash", "data").join(key.lazy(), on=["rank", "step", "key_hash"], how="semi")
    )
    return {RecordKey(int(r), int(s), int(k)): d for r, s, k, d in df.iter_rows()}


def arg_texts(run: Run, ranks: Sequence[int], digests: Sequence[str]) -> dict[str, str]:
    """args digest -> its text (the ``args`` table) for the given ranks; digests the run did not
    record a text for (too long, or a run written before the table existed) are absent."""
    if not digests or "args" not in run.tables:
        return {}
    lf = run.scan("args", ranks=sorted(set(ranks))).filter(pl.col("args_digest").is_in(sorted(set(digests))))
    df = collect(lf.select("args_digest", "text").unique("args_digest", keep="first", maintain_order=True))
    return dict(df.iter_rows())


def kernels(run: Run, calls: Collection[CallKey]) -> dict[CallKey, tuple[str, ...]]:
    """CallKey -> the kernel names launched under that call, in launch order."""
    if not calls:
        return {}
    key = pl.DataFrame(
        {"rank": [k[0] for k in calls], "step": [k[1] for k in calls], "call_hash": [k[2] for k in calls]},
        schema={"rank": pl.Int32, "step": pl.Int64, "call_hash": pl.UInt64},
    )
    lf = run.scan("kernels", ranks=sorted({k[0] for k in calls}), steps=sorted({k[1] for k in calls}))
    lf = lf.filter(pl.col("call_hash").is_in(key["call_hash"].unique().to_list()))
    df = collect(
        lf.select("rank", "step", "call_hash", "index", "kernel").join(
            key.lazy(), on=["rank", "step", "call_hash"], how="semi"
        )
    ).sort("rank", "step", "call_hash", "index")
    out: dict[CallKey, list[str]] = {}
    for r, s, h, _, k in df.iter_rows():
        out.setdefault(CallKey(int(r), int(s), int(h)), []).append(k)
    return {k: tuple(v) for k, v in out.items()}


@dataclass(frozen=True)
class Evidence:
    """What was read for the records a report names, beyond the walk's own reads."""

    #: Dumped bytes of the named records, per run (empty unless both runs dumped them).
    dumps_a: dict[RecordKey, bytes] = field(default_factory=dict)
    dumps_b: dict[RecordKey, bytes] = field(default_factory=dict)
    #: Kernels under the named calls, per run; None unless ``--depth kernel`` and both runs captured them.
    kernels_a: dict[CallKey, tuple[str, ...]] | None = None
    kernels_b: dict[CallKey, tuple[str, ...]] | None = None
    #: A hint when kernels were captured but not asked for.
    notes: tuple[str, ...] = ()


def gather(run_a: Run, run_b: Run, found: Mapping[int, Found], level: str) -> Evidence:
    """Dumps (and kernels at level kernel) of every record the walk found."""
    extracts = [x for f in found.values() for x in (f.first, f.next_clean) if x is not None]
    keys = sorted({x.record.key for x in extracts})
    both_kernels = "kernels" in run_a.tables and "kernels" in run_b.tables
    if level == Level.KERNEL and both_kernels:
        calls = sorted({x.record.call for x in extracts})
        kern: tuple[dict[CallKey, tuple[str, ...]] | None, dict[CallKey, tuple[str, ...]] | None]
        kern = (kernels(run_a, calls), kernels(run_b, calls))
        notes: tuple[str, ...] = ()
    else:
        kern = (None, None)
        notes = (
            ("kernel identities were captured: rerun with --depth kernel to compare them",)
            if both_kernels and found
            else ()
        )
    return Evidence(dumps(run_a, keys), dumps(run_b, keys), kern[0], kern[1], notes)


def discriminator(run_a: Run, run_b: Run, results: Sequence[RankResult], diag: Diagnosis) -> Discriminator | None:
    origin = [r for r in results if r.rank in diag.origin_ranks and r.effective is not None]
    if not origin or origin[0].effective is None or origin[0].effective.op is None:
        return None
    eff = origin[0].effective
    op, kind = eff.op, eff.kind
    if kind in INPUTLESS_KINDS:
        return None  # a source (batch, RNG, restored state) is not an op with instances to compare
    chosen = [r for r in origin if r.effective and r.effective.op == op][:DISCRIMINATOR_RANKS]
    pairs = {r.rank: r.effective.step for r in chosen if r.effective}
    cols = list(_align.ALIGN_COLUMNS)

    def side(run: Run) -> pl.DataFrame:
        lf = run.scan("records", ranks=sorted(pairs), steps=sorted(set(pairs.values())), columns=cols)
        key = pl.DataFrame(
            {"rank": list(pairs), "step": list(pairs.values())}, schema={"rank": pl.Int32, "step": pl.Int64}
        )
        lf = lf.filter((pl.col("name") == op) & (pl.col("kind") == kind)).select(*cols, _align.HAZARD_FLAG)
        return _align.prepare(collect(lf.join(key.lazy(), on=["rank", "step"], how="semi")), one_step_per_rank=True)

    al = _align.align(side(run_a), side(run_b))
    if not al.height:
        return None
    calls = al.group_by("rank", "step", "call_hash").agg(
        pl.col("state").is_in(_align.DIVERGENT_STATES).any().alias("divergent"),
        pl.col("phase").first(),
        pl.col("module").first(),
        pl.coalesce("dtype_a", "dtype_b").sort_by(pl.col("role") != "output").first().alias("dtype"),
        pl.coalesce("shape_a", "shape_b").sort_by(pl.col("role") != "output").first().alias("shape"),
    )
    grouped = (
        calls.with_columns(pl.col("shape").cast(pl.List(pl.Int64)))
        .group_by("dtype", "shape", "module", "phase")
        .agg((~pl.col("divergent")).sum().alias("clean"), pl.col("divergent").sum().alias("divergent"))
    )
    rows = [
        DiscriminatorRow(
            r["dtype"],
            None if r["shape"] is None else tuple(r["shape"]),
            r["module"],
            r["phase"],
            int(r["clean"]),
            int(r["divergent"]),
        )
        for r in grouped.to_dicts()
    ]
    rows.sort(key=lambda x: (-x.divergent, x.phase, x.module, str(x.dtype), x.shape or ()))
    return Discriminator(op, tuple(sorted(pairs)), tuple(sorted(set(pairs.values()))), tuple(rows))
