"""docs/trace-format.md stays in sync with the contract: column tables, enums and manifest keys.

Run ``python -m tests.unit.test_reader_docs`` to print the generated sections to paste into the doc.
"""

from __future__ import annotations

from pathlib import Path

from detfp_format import contract

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"


def render_tables() -> str:
    """One Markdown table per contract table: column, type, nullable, meaning."""
    out = []
    for table, cols in contract.TABLES.items():
        out.append(f"### `{table}`\n")
        out.append("| column | type | null | meaning |")
        out.append("|---|---|---|---|")
        for c in cols:
            doc = c.doc.replace("|", "\\|")
            out.append(f"| `{c.name}` | `{c.type}` | {'yes' if c.nullable else 'no'} | {doc} |")
        out.append("")
    return "\n".join(out)


def render_manifest_keys() -> str:
    lines = ["| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {v.replace('|', chr(92) + '|')} |" for k, v in contract.MANIFEST_KEYS.items()]
    return "\n".join(lines) + "\n"


def render_enums() -> str:
    enums = {
        "KINDS": contract.KINDS,
        "INPUTLESS_KINDS": contract.INPUTLESS_KINDS,
        "ROLES": contract.ROLES,
        "PHASES": contract.PHASES,
        "STATUSES": contract.STATUSES,
        "HAZARDS": contract.HAZARDS,
        "EVENT_TYPES": contract.EVENT_TYPES,
    }
    return "\n".join(f"- `{k}`: {', '.join(f'`{v}`' for v in vs)}" for k, vs in enums.items()) + "\n"


def test_doc_contains_the_generated_column_tables():
    text = DOC.read_text(encoding="utf-8")
    assert render_tables() in text, "docs/trace-format.md is stale: run python -m tests.unit.test_reader_docs"


def test_doc_contains_manifest_keys_and_enums():
    text = DOC.read_text(encoding="utf-8")
    assert render_manifest_keys() in text
    assert render_enums() in text


def test_doc_states_versions_and_layout():
    text = DOC.read_text(encoding="utf-8")
    assert f"schema version {contract.SCHEMA_VERSION}" in text
    assert f"digest version {contract.DIGEST_VERSION}" in text
    for path in (contract.shard_relpath("records", 0, 0, 0), contract.manifest_relpath(0, 0)):
        assert path.split("/")[-1] in text


def test_doc_hash_example_is_right():
    text = DOC.read_text(encoding="utf-8")
    ck = contract.call_key(-1, "forward", "layers.0.mlp", "op", "aten::mm.default", 0)
    assert f"`call_hash` {contract.key_hash(ck)}" in text
    assert f"`key_hash` {contract.key_hash(contract.record_key(ck, 'output', 'out'))}" in text


def test_doc_lists_optional_manifest_keys_and_a_valid_commit_log_example():
    import re

    from detfp_format import commitlog

    text = DOC.read_text(encoding="utf-8")
    for key, meaning in contract.MANIFEST_OPTIONAL_KEYS.items():
        assert f"| `{key}` | {meaning} |" in text
    example = [line for line in text.splitlines() if re.fullmatch(r"[0-9a-f]{8} \{.*\}", line)]
    state = commitlog.parse(("\n".join(example) + "\n").encode())
    assert len(example) == 3 and state.opened and state.close == (5, "ok", None) and state.bad_lines == 0


def test_reliability_and_certify_docs_name_every_gap_kind():
    from detfp_analyze.io.completeness import GAP_KINDS

    docs = DOC.parent
    for name in ("reliability.md", "certify.md"):
        text = (docs / name).read_text(encoding="utf-8")
        missing = [k for k in GAP_KINDS if f"`{k}`" not in text]
        assert not missing, f"docs/{name} does not describe {missing}"


if __name__ == "__main__":
    print(render_tables())
    print(render_manifest_keys())
    print(render_enums())
