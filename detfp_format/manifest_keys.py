"""The keys of a per-rank manifest and what each means (part of the trace contract,
re-exported by ``detfp_format.contract``; standard library only, no imports)."""

from __future__ import annotations

__all__ = ["MANIFEST_KEYS", "MANIFEST_OPTIONAL_KEYS"]

#: Top-level keys of a per-rank manifest (``manifest/rank=R/segment-S.json``), each with
#: its meaning. Values are JSON; ``null`` where a fact is unknown (e.g. no CUDA).
MANIFEST_KEYS: dict[str, str] = {
    "schema_version": "int: SCHEMA_VERSION of the writer.",
    "digest_version": "int: version of the digests in this run, a key of DIGEST_VERSIONS (DIGEST_VERSION unless the capture asked for another).",
    "digest_algorithm": "str: the algorithm's name, DIGEST_VERSIONS[digest_version].",
    "rank": "int: global rank.",
    "world_size": "int: number of ranks in the job (the process group's size once the group exists, even when the session opened before it; every rank in `groups` is below it).",
    "segment": "int: process launch (0 first, +1 per appended resume).",
    "start_step": "int|null: first step this segment captures (a resumed run's checkpoint step).",
    "parallel": "object: this rank's parallel coordinates {tp, pp, dp, cp, ep: int} and sizes {tp_size, ...} where known.",
    "groups": "object: logical process-group name -> list of global ranks, for the groups this rank used (and every dimension of a `DeviceMesh` its watched parameters live on). A name that starts with one of `DATA_PARALLEL_GROUPS` (`dp`, `fsdp`, `hsdp`, `ddp`, `edp`, `data`: `dp`, `dp_cp`, `dp_shard`...) says data parallelism: a gradient reduction runs over it.",
    "versions": "object: torch, cuda, cudnn, nccl, python, os, detfp, and the numerics libraries numpy, triton, transformer_engine, flash_attn, apex, xformers, torchao, deepspeed, megatron_core, intel_extension_for_pytorch (null when not installed).",
    "host": "object: hostname, device_count, devices (names), cpu (model string), local_rank.",
    "determinism": "object: the numerics settings in force when the first step begins (detfp_capture.numerics): deterministic_algorithms, deterministic_warn_only, cudnn_deterministic, cudnn_benchmark, cuda_matmul_allow_tf32, cudnn_allow_tf32, float32_matmul_precision, fill_uninitialized_memory, num_threads, num_interop_threads; `backends.<module>.<flag>` for every torch.backends flag that selects a kernel or a precision; `autocast.<device>.enabled`, `autocast.<device>.dtype` (null when disabled) and `autocast.cache_enabled` as the first step's forward runs. Runs of earlier releases hold the first ten keys only.",
    "env": "object: numerics-relevant environment variables (CUBLAS_WORKSPACE_CONFIG, NCCL_*, NVTE_*, CUDA_*, TORCH_*, OMP_NUM_THREADS, MKL_*, PYTHONHASHSEED, ...), name -> value; absent variables are omitted.",
    "git": "object: commit, dirty (bool), root of the training code's repository; nulls outside git.",
    "command": "list[str]: sys.argv of the training process.",
    "capture": "object: the capture configuration (level, steps, ranks, modules, rows, moments, dumps, kernels, poison, ...).",
}

#: Manifest keys added after schema version 1 was first written: writers of this release
#: always write them, readers accept manifests without them (older runs) and say so.
MANIFEST_OPTIONAL_KEYS: dict[str, str] = {
    "commit_log": "int: version of the commit log next to this manifest (segment-S.commits: committed flush windows and the clean-close line). Absent in runs written before the completeness contract: readers treat those as legacy and cannot verify their completeness.",
    "rollups": "int: ROLLUP_VERSION of the rollups table this launch writes next to its records. Absent in runs written before it: analyses read those runs' records (slower, same answer).",
    "shard_facts": "int: SHARD_FACTS_VERSION of the shards field of this launch's commit lines (each shard's bytes, step range and footer checksum). Absent in runs written before it: readers parse every shard footer when opening the run (slower, same answer).",
    "settings_changed_at": "int: the first step at which a numerics setting (a key of `determinism`) differed from the step before; from there on each change is a `setting_changed` event. Absent when none changed (and in runs written before it).",
    "step_sums": "int: STEP_SUMS_VERSION of the sums field of this launch's commit lines (per step: the records' rollup and the metrics, folded). Absent in runs written before it: analyses read the rollups and metrics shards of every compared step (slower, same answer).",
}
