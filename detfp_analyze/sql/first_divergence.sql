-- The first divergence of each rank, exactly as bisect finds it (created only with two runs).
-- The rule is detfp_analyze.rule's: the $${...} fragments below are rendered from its expressions
-- when connect() loads this file, and private tables _scope_ranks, _scope_window and
-- _scope_boundary hold bisect's scope (detfp_analyze.bisect.scope.plan): the compared ranks, the
-- common step window and the resume boundary steps. Steps are walked in order per rank; see the
-- module docstring of detfp_analyze.rule for the walk.

-- Private: run a's records in the compared scope, with their position in their rank-step
-- (segment, then seq: the rank's own order) and their hazard flag.
-- @column hazard   The record carries a hazard flag (detfp_analyze.rule.RECORD_HAZARD).
-- @column pos      Position of the record in its rank-step, in the rank's own (segment, seq) order.
CREATE VIEW _a_scoped AS
SELECT *, ${record_hazard} AS hazard, row_number() OVER (PARTITION BY rank, step ORDER BY segment, seq) - 1 AS pos
FROM a_records
WHERE rank IN (SELECT rank FROM _scope_ranks)
  AND step BETWEEN (SELECT lo FROM _scope_window) AND (SELECT hi FROM _scope_window);

-- Private: run b's records in the compared scope (as _a_scoped).
CREATE VIEW _b_scoped AS
SELECT *, ${record_hazard} AS hazard, row_number() OVER (PARTITION BY rank, step ORDER BY segment, seq) - 1 AS pos
FROM b_records
WHERE rank IN (SELECT rank FROM _scope_ranks)
  AND step BETWEEN (SELECT lo FROM _scope_window) AND (SELECT hi FROM _scope_window);

-- Private: the records of the scope aligned per rank-step (bisect's align): each pair's match,
-- its state (the match, or reordered / shifted), its two positions and its walk priority.
-- @column call_hash_a  call_hash of the record in A (null when only_b).
-- @column call_hash_b  call_hash of the record in B (null when only_a).
-- @column pos_a        Position of the record in its rank-step in A (null when only_b).
-- @column pos_b        Position of the record in its rank-step in B (null when only_a).
-- @column digest_hi_a  High 64 bits of the digest in A (compared as integers, never as hex).
-- @column digest_hi_b  High 64 bits of the digest in B.
-- @column digest_lo_a  Low 64 bits of the digest in A.
-- @column digest_lo_b  Low 64 bits of the digest in B.
-- @column hazard_a     The record carries a hazard flag in A.
-- @column hazard_b     The record carries a hazard flag in B.
-- @column state        The match, or unknown for a state-before-step record one run only holds (detfp_analyze.rule.UNSTARTED), or reordered (matched records in another order) or shifted (a call-site family with another number of calls): detfp_analyze.rule.STATES.
-- @column o1           The lesser of the record's two positions (the walk's order).
-- @column o2           The greater of the record's two positions.
-- @column prio         0 for restored state (detfp_analyze.rule.BOUNDARY_KINDS) at a resume boundary step, else 1: compared first.
-- @column hz           The record carries a hazard flag on either side and its call's arguments do not differ (detfp_analyze.rule.HAZARD).
CREATE VIEW _aligned AS
WITH j AS (
  SELECT
    ${joined_key},
    ${match} AS match,
    a.call_hash AS call_hash_a,
    b.call_hash AS call_hash_b,
    a.pos AS pos_a,
    b.pos AS pos_b,
    a.seq AS seq_a,
    b.seq AS seq_b,
    a.segment AS segment_a,
    b.segment AS segment_b,
    a.status AS status_a,
    b.status AS status_b,
    a.digest_hi AS digest_hi_a,
    b.digest_hi AS digest_hi_b,
    a.digest_lo AS digest_lo_a,
    b.digest_lo AS digest_lo_b,
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
    b.args_digest AS args_digest_b,
    a.hazard AS hazard_a,
    b.hazard AS hazard_b
  FROM _a_scoped AS a
  FULL OUTER JOIN _b_scoped AS b
    ON a.rank = b.rank AND a.step = b.step AND a.key_hash = b.key_hash
),
shifted AS (
  SELECT rank, step, ${family}
  FROM j
  GROUP BY rank, step, ${family}
  HAVING count(DISTINCT call_hash_a) <> count(DISTINCT call_hash_b)
    AND count(DISTINCT call_hash_a) > 0 AND count(DISTINCT call_hash_b) > 0
),
moved AS (
  SELECT rank, step, key_hash
  FROM (
    SELECT rank, step, key_hash,
      row_number() OVER (PARTITION BY rank, step ORDER BY pos_a) AS ia,
      row_number() OVER (PARTITION BY rank, step ORDER BY pos_b) AS ib
    FROM j
    WHERE pos_a IS NOT NULL AND pos_b IS NOT NULL
  )
  WHERE ia <> ib
)
SELECT
  j.*,
  CASE
    WHEN ${unstarted} THEN '${unknown}'
    WHEN m.key_hash IS NOT NULL AND j.match <> '${unknown}' THEN '${reordered}'
    WHEN s.rank IS NOT NULL AND j.match IN (${shiftable}) THEN '${shifted}'
    ELSE j.match
  END AS state,
  least(j.pos_a, j.pos_b) AS o1,
  greatest(j.pos_a, j.pos_b) AS o2,
  CASE WHEN j.step IN (SELECT step FROM _scope_boundary) AND j.kind IN (${boundary_kinds}) THEN 0 ELSE 1 END AS prio,
  ${hazard} AS hz
FROM j
LEFT JOIN shifted AS s
  ON s.rank = j.rank AND s.step = j.step AND ${family_on}
LEFT JOIN moved AS m
  ON m.rank = j.rank AND m.step = j.step AND m.key_hash = j.key_hash;

-- Private: per run, rank-step and call-site family, the sorted calls, each the sorted signatures
-- of its records (detfp_analyze.rule.SIGNATURE): the same-calls test of a reordered step. The
-- state a capture starts from (detfp_analyze.rule.START_KINDS) is no call of the step.
-- @column run      Which run: 'a' or 'b'.
-- @column calls    The family's calls, each its records' signatures joined, sorted.
CREATE VIEW _family_calls AS
WITH rec AS (
  SELECT 'a' AS run, rank, step, ${family}, call_hash, ${signature} AS sig FROM _a_scoped
  WHERE kind NOT IN (${start_kinds})
  UNION ALL
  SELECT 'b' AS run, rank, step, ${family}, call_hash, ${signature} AS sig FROM _b_scoped
  WHERE kind NOT IN (${start_kinds})
),
calls AS (
  SELECT run, rank, step, ${family}, call_hash, string_agg(sig, chr(30) ORDER BY sig) AS call
  FROM rec
  GROUP BY run, rank, step, ${family}, call_hash
)
SELECT run, rank, step, ${family}, list(call ORDER BY call) AS calls
FROM calls
GROUP BY run, rank, step, ${family};

-- Private: rank-steps whose calls are the same in both runs up to their order within each
-- call-site family (no value changed, only occurrence keys moved).
-- @column same_calls  Every family holds the same multiset of calls in A and B.
CREATE VIEW _same_calls AS
SELECT coalesce(a.rank, b.rank) AS rank, coalesce(a.step, b.step) AS step,
  bool_and(a.calls IS NOT DISTINCT FROM b.calls) AS same_calls
FROM (SELECT * FROM _family_calls WHERE run = 'a') AS a
FULL OUTER JOIN (SELECT * FROM _family_calls WHERE run = 'b') AS b
  ON a.rank = b.rank AND a.step = b.step AND ${family_on_ab}
GROUP BY ALL;

-- Private: per rank-step holding a divergence, its first divergent record (every column of it),
-- its first one outside calls under a hazard, and whether the step changes a value: the walk's
-- decision for the step.
-- @column value            The record is evidence that a value differs (detfp_analyze.rule.VALUE).
-- @column call_hz          A record of its call is under a hazard (hz: a likely false root).
-- @column call_inputs      Number of input records of the same call (same rank, step, call_hash); for a module's output, whose inputs are recorded by its module_input (or batch) call, that call's: bisect's count.
-- @column inputs_differing Number of those inputs whose match is not 'same'.
-- @column clean_key        key_hash of the step's first divergent record whose call carries no hazard, by (o1, o2, key_hash).
-- @column n_values         Records of the step not under a hazard that are evidence a value differs.
-- @column changes_value    The step changes a value: n_values > 0, unless its first divergence is reordered or shifted and the calls are the same up to order.
-- @column false_root       Its first divergence is under a hazard and no divergence lies outside hazard calls.
CREATE VIEW _step_walk AS
WITH counted AS (
  SELECT
    *,
    ${value} AS value,
    bool_or(hz) OVER (PARTITION BY rank, step, call_hash) AS call_hz,
    count(*) FILTER (WHERE role = 'input') OVER (PARTITION BY rank, step, call_hash) AS own_inputs,
    count(*) FILTER (WHERE role = 'input' AND match <> '${same}') OVER (PARTITION BY rank, step, call_hash)
      AS own_differing,
    -- A module boundary is two calls: its inputs are its module_input (batch at the root) twin's.
    count(*) FILTER (WHERE role = 'input' AND kind IN ('module_input', 'batch'))
      OVER (PARTITION BY rank, step, microbatch, phase, module, name, occurrence) AS twin_inputs,
    count(*) FILTER (WHERE role = 'input' AND kind IN ('module_input', 'batch') AND match <> '${same}')
      OVER (PARTITION BY rank, step, microbatch, phase, module, name, occurrence) AS twin_differing
  FROM _aligned
),
rows AS MATERIALIZED (
  SELECT
    * EXCLUDE (own_inputs, own_differing, twin_inputs, twin_differing),
    CASE WHEN kind = 'module_output' AND own_inputs = 0 THEN twin_inputs ELSE own_inputs END AS call_inputs,
    CASE WHEN kind = 'module_output' AND own_inputs = 0 THEN twin_differing ELSE own_differing END AS inputs_differing
  FROM counted
),
first AS (
  SELECT *
  FROM rows
  WHERE state IN (${divergent})
  QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY prio, o1, o2, key_hash) = 1
),
clean AS (
  SELECT rank, step, key_hash AS clean_key
  FROM rows
  WHERE state IN (${divergent}) AND NOT call_hz
  QUALIFY row_number() OVER (PARTITION BY rank, step ORDER BY o1, o2, key_hash) = 1
),
vals AS (
  SELECT rank, step, count(*) FILTER (WHERE value AND NOT hz) AS n_values FROM rows GROUP BY rank, step
)
SELECT
  f.*,
  c.clean_key,
  v.n_values,
  v.n_values > 0 AND NOT (f.state IN ('${reordered}', '${shifted}') AND coalesce(sc.same_calls, false))
    AS changes_value,
  f.call_hz AND c.clean_key IS NULL AS false_root
FROM first AS f
JOIN vals AS v ON v.rank = f.rank AND v.step = f.step
LEFT JOIN clean AS c ON c.rank = f.rank AND c.step = f.step
LEFT JOIN _same_calls AS sc ON sc.rank = f.rank AND sc.step = f.step;

-- Per rank, its first divergence as bisect reports it (detfp_analyze.rule: the rank's first
-- step that changes a value, or the first likely false root before it), in the compared scope
-- (bisect's ranks, common steps and resume boundaries). Ranks where no value differs have no
-- row. Also says whether the inputs of that record's call matched: an output whose inputs all
-- matched is where the difference was introduced (an origin); otherwise the difference arrived
-- from an earlier, uncaptured producer or from another rank.
-- @column state              differs | only_a | only_b | reordered | shifted: the record's state in its rank-step (detfp_analyze.rule.STATES).
-- @column pos_a              Position of the record in its rank-step in A (the rank's own order; null when only_b).
-- @column pos_b              Position of the record in its rank-step in B (null when only_a).
-- @column likely_false_root  The record or another of its call is under a hazard (hz): bisect's likely false root.
-- @column next_step          With likely_false_root: the step of the next divergence free of hazards (bisect's next_clean).
-- @column next_key_hash      With likely_false_root: the key_hash of that divergence.
CREATE VIEW first_divergence AS
WITH w AS MATERIALIZED (
  SELECT * FROM _step_walk
),
real AS (
  SELECT rank, step, key_hash, call_hz, clean_key
  FROM w
  WHERE changes_value AND NOT false_root
  QUALIFY row_number() OVER (PARTITION BY rank ORDER BY step) = 1
),
held AS (
  SELECT w.rank, w.step
  FROM w
  JOIN real AS r ON r.rank = w.rank AND w.step < r.step
  WHERE w.false_root
  QUALIFY row_number() OVER (PARTITION BY w.rank ORDER BY w.step) = 1
),
picked AS (
  SELECT
    r.rank,
    coalesce(h.step, r.step) AS step,
    h.rank IS NOT NULL OR r.call_hz AS likely_false_root,
    CASE WHEN h.rank IS NOT NULL OR r.call_hz THEN r.step END AS next_step,
    CASE
      WHEN h.rank IS NOT NULL AND NOT r.call_hz THEN r.key_hash
      WHEN h.rank IS NOT NULL OR r.call_hz THEN r.clean_key
    END AS next_key_hash
  FROM real AS r
  LEFT JOIN held AS h ON h.rank = r.rank
)
SELECT
  x.rank, x.step, x.key_hash, x.call_hash, x.microbatch, x.phase, x.module, x.kind, x.name, x.occurrence,
  x.role, x.arg, x.match, x.state, x.seq_a, x.seq_b, x.segment_a, x.segment_b, x.status_a, x.status_b,
  x.digest_a, x.digest_b, x.dtype_a, x.dtype_b, x.shape_a, x.shape_b, x.m_sum_a, x.m_sum_b,
  x.hazards_a, x.hazards_b, x.args_digest_a, x.args_digest_b, x.pos_a, x.pos_b,
  p.likely_false_root, p.next_step, p.next_key_hash, x.call_inputs, x.inputs_differing
FROM picked AS p
JOIN w AS x ON x.rank = p.rank AND x.step = p.step
ORDER BY x.rank;
