"""Per-column Parquet encodings of the shards (issue 15's trace size): the values read back are
the same, the encodings are the ones ``arrowschema.parquet_options`` names, and shards written
before (every column dictionary-encoded) still read the same way."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from detfp_format import contract
from detfp_format.arrowschema import parquet_options
from detfp_format.writer import ShardWriter, build_table
from tests.unit.test_writer import _records


def _encodings(path) -> dict[str, tuple[str, ...]]:
    rg = pq.ParquetFile(path).metadata.row_group(0)
    return {rg.column(i).path_in_schema: rg.column(i).encodings for i in range(rg.num_columns)}


def test_options_name_every_column_once():
    for table in contract.TABLES:
        opts = parquet_options(table)
        names = {c.name for c in contract.columns(table)}
        dictionary, special = set(opts["use_dictionary"]), set(opts["column_encoding"])
        assert dictionary | special == names and not dictionary & special
        for c in contract.columns(table):
            if c.type == "uint64":
                assert opts["column_encoding"][c.name] == "PLAIN"
    assert parquet_options("records")["column_encoding"]["seq"] == "DELTA_BINARY_PACKED"


def test_written_shards_use_the_encodings_and_keep_the_values(tmp_path):
    cols = _records(300)
    with ShardWriter(tmp_path, rank=0, segment=0) as w:
        w.write_window({"records": {k: list(v) for k, v in cols.items()}})
    path = tmp_path / contract.shard_relpath("records", 0, 0, 0)
    enc = _encodings(path)
    assert "DELTA_BINARY_PACKED" in enc["seq"]
    for c in ("digest_hi", "digest_lo", "call_hash", "key_hash"):
        assert "RLE_DICTIONARY" not in enc[c] and "PLAIN" in enc[c]
    assert "RLE_DICTIONARY" in enc["module"]
    got = pq.read_table(path)
    want = build_table("records", cols, 0, 0)
    # The same rows in the same order, bit for bit (the writer adds only the key hashes).
    for c in want.column_names:
        if c not in ("call_hash", "key_hash"):
            assert got.column(c).equals(want.column(c)), c


def test_a_shard_with_the_old_encoding_reads_the_same(tmp_path):
    t = build_table("records", _records(50), 0, 0)
    old, new = tmp_path / "old.parquet", tmp_path / "new.parquet"
    pq.write_table(t, old, compression="zstd")  # before issue 15: dictionary for every column
    pq.write_table(t, new, compression="zstd", **parquet_options("records"))
    assert pq.read_table(old).equals(pq.read_table(new))
    assert pa.types.is_uint64(pq.read_table(new).schema.field("digest_hi").type)
