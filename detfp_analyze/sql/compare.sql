-- Comparison views over runs A and B (created only when connect() is given two runs).
-- Records are matched by call-site key: (rank, step, key_hash), key_hash being the hash of
-- (microbatch, phase, module, kind, name, occurrence, role, arg). Sequence numbers are never
-- compared across runs or ranks; "first" always means first in one rank's own order.

-- Every record of A and of B matched by (rank, step, key_hash): a full outer join, so a record
-- present on one side only is kept and labelled (a structural difference: control flow differed).
-- @column rank        Global rank.
-- @column step        Absolute training step.
-- @column key_hash    Record key hash (the join key).
-- @column call_hash   Call key hash: equal for the records of one call.
-- @column microbatch  Microbatch index, or -1.
-- @column phase       Phase of the step (forward, backward, recompute, optimizer, step).
-- @column module      Module path innermost at the call, '' outside any module.
-- @column kind        What was fingerprinted (op, collective, param, ...).
-- @column name        Op overload, collective, parameter, probe or metric name.
-- @column occurrence  Calls with the same key fields before this one on this rank.
-- @column role        input | output | value | dest (a write-only argument, never digested).
-- @column arg         Argument path inside the call.
-- @column match       same | differs | only_a | only_b | unknown: detfp_analyze.rule.MATCH (unknown: a side has no digest, status skipped or error, or the record is a write-only dest).
-- @column seq_a       seq of the record in A (null when only_b).
-- @column seq_b       seq of the record in B (null when only_a).
-- @column segment_a   Segment of the record in A.
-- @column segment_b   Segment of the record in B.
-- @column status_a    Digest status in A.
-- @column status_b    Digest status in B.
-- @column digest_a    32-hex digest in A.
-- @column digest_b    32-hex digest in B.
-- @column dtype_a     dtype in A.
-- @column dtype_b     dtype in B.
-- @column shape_a     Shape in A.
-- @column shape_b     Shape in B.
-- @column m_sum_a     Moment sum in A (null unless moments were captured).
-- @column m_sum_b     Moment sum in B.
-- @column hazards_a   Hazard flags in A (likely false root when non-empty).
-- @column hazards_b   Hazard flags in B.
-- @column args_digest_a  Digest of the call's non-tensor arguments in A.
-- @column args_digest_b  Digest of the call's non-tensor arguments in B.
CREATE VIEW pairs AS
SELECT
  ${joined_key},
  ${match} AS match,
  a.seq AS seq_a,
  b.seq AS seq_b,
  a.segment AS segment_a,
  b.segment AS segment_b,
  a.status AS status_a,
  b.status AS status_b,
  a.digest AS digest_a,
  b.digest AS digest_b,
  a.dtype AS dtype_a,
  b.dtype AS dtype_b,
  a.shape AS shape_a,
  b.shape AS shape_b,
  a.m_sum AS m_sum_a,
  b.m_sum AS m_sum_b,
  a.hazards AS hazards_a,
  b.hazards AS hazards_b,
  a.args_digest AS args_digest_a,
  b.args_digest AS args_digest_b
FROM a_records AS a
FULL OUTER JOIN b_records AS b
  ON a.rank = b.rank AND a.step = b.step AND a.key_hash = b.key_hash;

-- Metrics of A and B matched by (rank, step, microbatch, name, occurrence), compared bitwise.
-- @column rank        Global rank.
-- @column step        Absolute training step.
-- @column microbatch  Microbatch index, or -1.
-- @column name        Metric name.
-- @column occurrence  Metrics of the same (step, microbatch, name) before this one on this rank.
-- @column match       same | differs | only_a | only_b: bits compared, never printed values.
-- @column value_a     Value in A.
-- @column value_b     Value in B.
-- @column delta       value_b - value_a (null when one side is missing).
-- @column bits_a      Raw IEEE-754 bits in A.
-- @column bits_b      Raw IEEE-754 bits in B.
-- @column seq_a       seq in A.
-- @column seq_b       seq in B.
CREATE VIEW metric_pairs AS
SELECT
  coalesce(a.rank, b.rank) AS rank,
  coalesce(a.step, b.step) AS step,
  coalesce(a.microbatch, b.microbatch) AS microbatch,
  coalesce(a.name, b.name) AS name,
  coalesce(a.occurrence, b.occurrence) AS occurrence,
  CASE
    WHEN a.rank IS NULL THEN 'only_b'
    WHEN b.rank IS NULL THEN 'only_a'
    WHEN a.bits = b.bits THEN 'same'
    ELSE 'differs'
  END AS match,
  a.value AS value_a,
  b.value AS value_b,
  b.value - a.value AS delta,
  a.bits AS bits_a,
  b.bits AS bits_b,
  a.seq AS seq_a,
  b.seq AS seq_b
FROM a_metrics AS a
FULL OUTER JOIN b_metrics AS b
  ON a.rank = b.rank AND a.step = b.step AND a.microbatch = b.microbatch
  AND a.name = b.name AND a.occurrence = b.occurrence;

-- Per rank and step, how many record pairs match, differ or exist on one side only: the input
-- of the divergence heatmap (detfp_analyze.render.heatmap).
-- @column rank        Global rank.
-- @column step        Absolute training step.
-- @column records     Number of pairs (records of A and B matched by key).
-- @column same        Pairs whose match is same (equal digests and arguments).
-- @column differing   Pairs whose match is differs (digests or the call's arguments differ).
-- @column only_a      Records present in A only.
-- @column only_b      Records present in B only.
-- @column unknown     Pairs without evidence on a side (skipped, error, or a write-only dest).
CREATE VIEW step_summary AS
SELECT
  rank,
  step,
  count(*) AS records,
  count(*) FILTER (WHERE match = 'same') AS same,
  count(*) FILTER (WHERE match = 'differs') AS differing,
  count(*) FILTER (WHERE match = 'only_a') AS only_a,
  count(*) FILTER (WHERE match = 'only_b') AS only_b,
  count(*) FILTER (WHERE match = 'unknown') AS unknown
FROM pairs
GROUP BY rank, step
ORDER BY rank, step;
