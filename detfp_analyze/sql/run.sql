-- Per-run views. Loaded once per run with ${run} = a (and again with b when a second run is
-- given). Each reads the private source view _${run}_<table>_src that connect() builds from the
-- run's validated shard list (read_parquet over exactly those files, without the rows a later
-- segment of the same rank captured again: the reader's supersession rule). Columns not listed
-- under @column are the trace contract's (docs/trace-format.md); their comments are filled in
-- from detfp_format.contract.

-- Every fingerprint record of run ${run}, one row per tensor, with a hex digest.
-- @column digest   The 128-bit digest as 32 lowercase hex (digest_hi then digest_lo), null unless status = 'ok'.
-- @column shard    Path of the Parquet shard the row was read from (provenance).
CREATE VIEW ${run}_records AS
SELECT
  * EXCLUDE (shard),
  CASE WHEN status = 'ok' THEN printf('%016x%016x', digest_hi, digest_lo) END AS digest,
  shard
FROM _${run}_records_src;

-- Every scalar metric (loss, grad_norm, lr, ...) of run ${run}; compare bits, never values.
-- @column shard    Path of the Parquet shard the row was read from (provenance).
CREATE VIEW ${run}_metrics AS
SELECT * FROM _${run}_metrics_src;

-- Every capture event (step_begin/step_end, hazards, pending collectives, capture errors, ...) of run ${run}.
-- @column shard    Path of the Parquet shard the row was read from (provenance).
CREATE VIEW ${run}_events AS
SELECT * FROM _${run}_events_src;

-- Kernel (or innermost profiler event) names launched under each op of run ${run}; empty unless captured.
-- @column shard    Path of the Parquet shard the row was read from (provenance).
CREATE VIEW ${run}_kernels AS
SELECT * FROM _${run}_kernels_src;

-- Raw tensor bytes dumped for chosen records of run ${run}; empty unless captured.
-- @column nbytes   Length of data in bytes.
-- @column shard    Path of the Parquet shard the row was read from (provenance).
CREATE VIEW ${run}_dumps AS
SELECT * EXCLUDE (shard), octet_length(data) AS nbytes, shard FROM _${run}_dumps_src;
