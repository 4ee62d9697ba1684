"""`export --perfetto`: a trace-event file valid for the Perfetto UI, one track per rank, bounded."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.cli import app
from detfp_analyze.render.perfetto import trace
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

SAMPLES = Path(__file__).parent.parent.parent / "sample_traces"
_META = {
    "process_name": "name",
    "thread_name": "name",
    "process_sort_index": "sort_index",
    "thread_sort_index": "sort_index",
}


def validate_trace(obj: dict) -> list[str]:
    """Problems with ``obj`` as a Chrome/Perfetto JSON trace (the trace-event format's object form):
    required fields and types per phase, metadata records, and complete (X) events properly nested
    on each (pid, tid) track, which the UI needs to draw a slice stack."""
    bad: list[str] = []
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        return ["top level: an object with a traceEvents array is required"]
    if obj.get("displayTimeUnit") not in (None, "ms", "ns"):
        bad.append(f"displayTimeUnit {obj.get('displayTimeUnit')!r}: ms or ns")
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    named: set[tuple[int, int]] = set()
    for i, e in enumerate(obj["traceEvents"]):
        where = f"event {i} ({e.get('name')!r})"
        if not isinstance(e.get("name"), str) or not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            bad.append(f"{where}: name (string), pid and tid (integers) are required")
            continue
        ph = e.get("ph")
        if ph == "M":
            key = _META.get(e["name"])
            if key is None or not isinstance(e.get("args"), dict) or key not in e["args"]:
                bad.append(f"{where}: metadata event needs a known name and args.{key}")
            elif e["name"] == "thread_name":
                named.add((e["pid"], e["tid"]))
            continue
        if not isinstance(e.get("ts"), (int, float)):
            bad.append(f"{where}: ts (a number) is required")
            continue
        if "args" in e and not isinstance(e["args"], dict):
            bad.append(f"{where}: args must be an object")
        if ph == "X":
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                bad.append(f"{where}: X needs dur >= 0")
                continue
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph == "i":
            if e.get("s") not in ("g", "p", "t"):
                bad.append(f"{where}: instant scope s must be g, p or t")
            tracks.setdefault((e["pid"], e["tid"]), [])
        else:
            bad.append(f"{where}: phase {ph!r} is not used by this exporter")
    for key, slices in tracks.items():
        if key not in named:
            bad.append(f"track {key}: no thread_name")
        stack: list[tuple[float, float, str]] = []
        for s in sorted(slices, key=lambda x: (x[0], -x[1])):
            while stack and s[0] >= stack[-1][1]:
                stack.pop()
            if stack and s[1] > stack[-1][1]:
                bad.append(f"track {key}: {s[2]!r} [{s[0]}, {s[1]}) overlaps {stack[-1][2]!r} without nesting")
                break
            stack.append(s)
    return bad


def _export(args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["export", *args])
    return res.exit_code, res.output


def test_validator_catches_bad_traces():
    ok = {"name": "x", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 4}
    meta = {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "t"}}
    assert validate_trace({"traceEvents": [meta, ok, {**ok, "ts": 1, "dur": 2}]}) == []
    assert "overlaps" in validate_trace({"traceEvents": [meta, ok, {**ok, "ts": 2, "dur": 4}]})[0]
    assert "dur >= 0" in validate_trace({"traceEvents": [meta, {**ok, "dur": -1}]})[0]
    assert "no thread_name" in validate_trace({"traceEvents": [ok]})[0]
    assert validate_trace([]) == ["top level: an object with a traceEvents array is required"]


def test_export_of_a_layout_pair(layout_pair, tmp_path):
    out = tmp_path / "trace.json"
    code, text = _export([str(layout_pair.a), str(layout_pair.b), "--perfetto", str(out)])
    assert code == 0, text
    assert text.startswith(f"wrote {out}: ") and "48 rank(s), steps 0-2" in text
    obj = json.loads(out.read_text())
    assert validate_trace(obj) == []
    ev = obj["traceEvents"]
    procs = [e["args"]["name"] for e in ev if e["name"] == "process_name"]
    assert procs == ["pp 0", "pp 1", "pp 2", "pp 3"]
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert len(threads) == 48 and threads[29] == "rank 29 (pp 2, dp 2, tp 1)"
    marks = {e["tid"]: e for e in ev if e["ph"] == "i"}
    assert sorted(marks) == list(range(48))
    assert Counter(m["name"] for m in marks.values()) == {
        "first divergence: receiver": 47,
        "first divergence: origin": 1,
    }
    origin = marks[29]
    assert (
        origin["args"]["verdict"] == "origin" and "this call introduced the difference" in origin["args"]["explanation"]
    )
    # The mark sits on the first differing call of its track, and that call is the planted op.
    calls = [e for e in ev if e["ph"] == "X" and e["tid"] == 29 and e["name"].startswith("≠ ")]
    first = min(calls, key=lambda e: e["ts"])
    assert first["ts"] <= origin["ts"] < first["ts"] + first["dur"]
    assert first["name"] == "≠ aten::addmm.default" and first["cname"] == "terrible"
    assert first["args"]["module"] == "layers.0.attn.proj"
    # Nesting: step > phase > module path > call.
    enclosing = sorted(
        (
            e
            for e in ev
            if e["ph"] == "X" and e["tid"] == 29 and e["ts"] <= first["ts"] < e["ts"] + e["dur"] and e is not first
        ),
        key=lambda e: -e["dur"],
    )
    assert [e["name"] for e in enclosing][:5] == ["step 1", "forward", "layers", "layers.0", "layers.0.attn"]
    # Step 0 is clean on every rank: no differing slice before the first gap.
    assert all(
        e["args"].get("differing", 0) == 0 for e in ev if e["ph"] == "X" and e["ts"] < first["ts"] and e["tid"] == 29
    )


def test_selection_size_guard_and_byte_stability(layout_pair, tmp_path):
    a, b = str(layout_pair.a), str(layout_pair.b)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert _export([a, b, "--perfetto", str(one), "--steps", "1", "--ranks", "28-29"])[0] == 0
    assert _export([a, b, "--perfetto", str(two), "--steps", "1", "--ranks", "28-29"])[0] == 0
    assert one.read_bytes() == two.read_bytes()
    obj = json.loads(one.read_text())
    assert validate_trace(obj) == []
    assert {e["tid"] for e in obj["traceEvents"] if e["ph"] != "M"} == {28, 29}
    assert {e["name"] for e in obj["traceEvents"] if e.get("cat") == "step"} == {"step 1"}
    code, text = _export([a, b, "--perfetto", str(tmp_path / "big.json"), "--max-records", "100"])
    assert code == 2 and not (tmp_path / "big.json").exists()
    assert text.strip() == (
        "detfp-analyze: the trace would hold 21600 records (steps 0-2, 48 ranks), more than --max-records 100; "
        "select fewer, e.g. --steps 1 --ranks 29, or raise --max-records"
    )
    code, text = _export([a, b, "--perfetto", str(tmp_path / "x.json"), "--ranks", "60"])
    assert code == 2 and "rank(s) 60 were not compared" in text


def test_records_of_one_run_only_sit_where_that_run_made_them(tmp_path):
    p = write_pair(
        tmp_path / "a",
        tmp_path / "b",
        SynthSpec(ranks=2, steps=1, records=120),
        Plant(rank=1, step=0, index=40, how="structural"),
    )
    res = bisect(p.a, p.b)
    obj = trace(p.a, p.b, res)
    assert validate_trace(obj) == []
    ev = [e for e in obj["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    extra = [e for e in ev if e["name"] == "≠ aten::clone.default"]
    assert len(extra) == 1 and extra[0]["args"]["records"] == 2
    kids = [
        e["name"] for e in ev if extra[0]["ts"] <= e["ts"] < extra[0]["ts"] + 2 and e["dur"] == 1 and e is not extra[0]
    ]
    assert kids == ["input args[0]: only_b", "output out: only_b"]
    mark = next(e for e in obj["traceEvents"] if e["ph"] == "i" and e["tid"] == 1)
    assert mark["name"] == "first divergence: structural" and mark["ts"] == extra[0]["ts"]  # at the inserted input
    # Rank 0 ran no extra call: same number of record slots on both ranks but one.
    assert sum(e["dur"] for e in obj["traceEvents"] if e.get("cat") == "step" and e["tid"] == 1) == 122
    assert sum(e["dur"] for e in obj["traceEvents"] if e.get("cat") == "step" and e["tid"] == 0) == 120


@pytest.mark.parametrize("pair", ["ops/a:ops/b", "resume/full:resume/resumed"])
def test_export_of_sample_traces(pair, tmp_path):
    a, b = (str(SAMPLES / x) for x in pair.split(":"))
    out = tmp_path / "t.json"
    code, text = _export([a, b, "--perfetto", str(out)])
    assert code == 0, text
    obj = json.loads(out.read_text())
    assert validate_trace(obj) == []
    assert any(e["ph"] == "i" for e in obj["traceEvents"])
