"""Data-parallel replica consistency inside one run (a ``certify`` check; no second run needed).

In data parallelism every rank of a group holds the same parameters after each optimizer step
(DDP broadcasts them at the start and reduces every gradient identically), so their
fingerprints must be bitwise equal across the group: replicas that drift apart silently (a
rank-local write, a missed reduction, an unsynchronized buffer) break every later step. Pure
function over the run's step-end parameter records (kind ``param``, phase ``step``) and, where
recorded, its reduced gradients (``reduced_grad`` outputs):

1. groups: ranks sharing every parallel coordinate except ``dp`` (manifest ``parallel``), or the
   whole world when the manifests name none;
2. per (group, record) the steps where all ranks agree, and the first later step where they
   do not. A record that never agreed is sharded, not replicated (FSDP, a tensor-parallel
   shard), and is left out: replicas are what agreed once;
3. per group, the first (step, record) where replicas split and which ranks split off (those
   outside the largest set of ranks that agree).

``replicated`` says whether a run is data parallel at all (certify reports a gradient reduction
capture did not see only then): with parallel coordinates in the manifests, whether a group above
has two ranks; without, whether two ranks hold the same parameters, every name and digest, at the
first step both recorded (pipeline stages and tensor-parallel shards hold different ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import polars as pl

__all__ = ["ReplicaSplit", "replica_splits", "replicated"]

_COORDS = ("tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class ReplicaSplit:
    """The first place where one group's data-parallel replicas stopped being bitwise equal."""

    #: Ranks of the data-parallel group.
    group: tuple[int, ...]
    #: Step whose end (or whose gradient reduction) shows the split.
    step: int
    #: ``param`` (a parameter after the step) or ``reduced_grad`` (a gradient after its reduction).
    kind: str
    #: Parameter FQN.
    name: str
    #: Ranks outside the largest set of ranks that agree.
    split_ranks: tuple[int, ...]
    #: The last step where every rank of the group agreed on this record.
    agreed_step: int
    #: Records of the group that differ across its ranks at ``step``.
    differing: int


def _groups(manifests: dict[int, dict[str, Any]]) -> dict[int, tuple]:
    """rank -> key of its data-parallel group (ranks with equal keys replicate each other)."""
    out = {}
    for rank, m in manifests.items():
        par = m.get("parallel") or {}
        out[rank] = tuple((k, par.get(k)) for k in _COORDS if k in par)
    return out


def replicated(records: pl.LazyFrame, manifests: dict[int, dict[str, Any]]) -> bool | None:
    """Whether some ranks of the run replicate each other (data parallelism); None when nothing
    tells (no parallel coordinates and no step-end parameters). ``records``: the run's records
    (only a few columns are read); ``manifests``: rank -> that rank's (latest) manifest."""
    if len(manifests) < 2:
        return False
    if any(m.get("parallel") for m in manifests.values()):
        keys = list(_groups(manifests).values())
        return len(set(keys)) < len(keys)
    params = (
        records.filter((pl.col("kind") == "param") & (pl.col("phase") == "step") & (pl.col("status") == "ok"))
        .select("rank", "step", "name", "occurrence", "digest_hi", "digest_lo")
        .collect()
    )
    if not params.height:
        return None
    # The first step every rank that recorded parameters holds (each rank's own first step when
    # none is common: a rank whose capture started later still shows its replicas).
    firsts = params.group_by("rank").agg(pl.col("step").min())
    common = set.intersection(*(set(g["step"]) for _, g in params.group_by("rank")))
    if common:
        at = params.filter(pl.col("step") == min(common))
    else:
        at = params.join(firsts, on=["rank", "step"], how="semi")
    sets = (
        at.sort("rank", "name", "occurrence")
        .group_by("rank", maintain_order=True)
        .agg(pl.col("name"), pl.col("occurrence"), pl.col("digest_hi"), pl.col("digest_lo"))
        .select(pl.struct("name", "occurrence", "digest_hi", "digest_lo").hash().alias("h"))
    )
    return sets["h"].n_unique() < sets.height


def replica_splits(records: pl.LazyFrame, manifests: dict[int, dict[str, Any]]) -> list[ReplicaSplit]:
    """The first replica split of each data-parallel group (at most one per group), sorted by
    step then group. ``records``: the run's records (only a few columns are read);
    ``manifests``: rank -> that rank's (latest) manifest."""
    keys = _groups(manifests)
    if len(keys) < 2:
        return []
    gid = {k: i for i, k in enumerate(sorted(set(keys.values()), key=repr))}
    rank_group = pl.DataFrame(
        {"rank": list(keys), "group": [gid[keys[r]] for r in keys]}, schema={"rank": pl.Int32, "group": pl.Int64}
    )
    df = (
        records.filter(
            (pl.col("status") == "ok")
            & (
                ((pl.col("kind") == "param") & (pl.col("phase") == "step"))
                | ((pl.col("kind") == "reduced_grad") & (pl.col("role") == "output"))
            )
        )
        .select("rank", "step", "kind", "name", "occurrence", "digest_hi", "digest_lo")
        .collect()
        .join(rank_group, on="rank", how="inner")
    )
    if not df.height:
        return []
    per = df.group_by("group", "kind", "name", "occurrence", "step").agg(
        pl.struct("digest_hi", "digest_lo").n_unique().alias("n"),
        pl.len().alias("ranks"),
    )
    size = rank_group.group_by("group").agg(pl.len().alias("size"))
    per = per.join(size, on="group").filter(pl.col("ranks") == pl.col("size"))
    agreed = (
        per.filter(pl.col("n") == 1)
        .group_by("group", "kind", "name", "occurrence")
        .agg(pl.col("step").min().alias("first_agreed"))
    )
    splits = (
        per.filter(pl.col("n") > 1)
        .join(agreed, on=["group", "kind", "name", "occurrence"])
        .filter(pl.col("step") > pl.col("first_agreed"))
    )
    if not splits.height:
        return []
    out = []
    for g in sorted(splits["group"].unique().to_list()):
        sg = splits.filter(pl.col("group") == g)
        step = cast("int", sg["step"].min())  # an integer column with rows: never None
        at = sg.filter(pl.col("step") == step).sort("kind", "name", "occurrence")
        first = at.row(0, named=True)
        rows = df.filter(
            (pl.col("group") == g)
            & (pl.col("step") == step)
            & (pl.col("kind") == first["kind"])
            & (pl.col("name") == first["name"])
            & (pl.col("occurrence") == first["occurrence"])
        )
        counts = rows.group_by("digest_hi", "digest_lo").agg(pl.col("rank").sort().alias("rs"), pl.len().alias("c"))
        # The largest set of agreeing ranks is the replica; ties go to the set with the lowest rank.
        best = counts.sort(["c", pl.col("rs").list.first()], descending=[True, False]).row(0, named=True)
        members = tuple(sorted(int(r) for r in rank_group.filter(pl.col("group") == g)["rank"]))
        last_agreed = per.filter(
            (pl.col("group") == g)
            & (pl.col("kind") == first["kind"])
            & (pl.col("name") == first["name"])
            & (pl.col("occurrence") == first["occurrence"])
            & (pl.col("n") == 1)
            & (pl.col("step") < step)
        )["step"].max()
        out.append(
            ReplicaSplit(
                members,
                step,
                first["kind"],
                first["name"],
                tuple(r for r in members if r not in set(best["rs"])),
                cast("int", last_agreed),  # the split is after first_agreed, so a step agreed before it
                at.height,
            )
        )
    out.sort(key=lambda s: (s.step, s.group))
    return out
