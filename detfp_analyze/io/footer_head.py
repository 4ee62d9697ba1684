"""The head of a Parquet footer without pyarrow: its schema's bytes and its row count.

A Parquet footer is a Thrift ``FileMetaData`` in the compact protocol: field 1 the format
version, field 2 the schema (a list of ``SchemaElement``), field 3 the number of rows, then the
row groups and the key-value metadata. ``committed_footers.FooterChecks`` checks every committed shard
against the contract before its first read (``docs/reliability.md``); the schema is the same
bytes in every shard a writer wrote of one table, so it is validated once per distinct schema,
and each shard costs only this: a walk over the first three fields (tens of microseconds; a
bisect of committed runs loads no pyarrow). Anything unexpected (another field order, a length
past the end, nesting deeper than a schema has) is None: the caller then parses the footer in
full and says what is wrong.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Head", "head", "stated_versions"]

# Compact protocol type ids.
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
#: Deeper nesting than any footer holds: a hostile one is refused, not recursed into.
_MAX_DEPTH = 16


class Head(NamedTuple):
    """The first fields of a footer."""

    #: The bytes of the schema field (the list of schema elements): equal bytes, equal schemas.
    schema: bytes
    #: The number of rows the footer states.
    num_rows: int


class _Bad(Exception):
    pass


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Bad
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out, shift = 0, 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise _Bad

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def advance(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise _Bad
        self.pos += n

    def skip(self, kind: int, depth: int) -> None:
        """Skip one value of compact type ``kind``."""
        if depth > _MAX_DEPTH:
            raise _Bad
        if kind in (_BOOL_TRUE, _BOOL_FALSE):
            return
        if kind == _BYTE:
            self.advance(1)
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.advance(8)
        elif kind == _BINARY:
            self.advance(self.varint())
        elif kind in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                if elem in (_BOOL_TRUE, _BOOL_FALSE):
                    self.advance(1)  # a list's booleans are a byte each
                else:
                    self.skip(elem, depth + 1)
        elif kind == _MAP:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == _STRUCT:
            last = 0
            while True:
                last, ftype = self.field(last)
                if ftype is None:
                    return
                self.skip(ftype, depth + 1)
        else:
            raise _Bad

    def field(self, last: int = 0) -> tuple[int, int | None]:
        """(field id, type) of the next field header; type None at the struct's end."""
        b = self.byte()
        if b == 0:
            return 0, None
        delta, kind = b >> 4, b & 0x0F
        return (last + delta if delta else self.zigzag()), kind


def head(footer: bytes) -> Head | None:
    """The schema bytes and row count of ``footer`` (a Parquet footer, its length and magic
    included or not); None when its first fields are not version, schema, rows in that order."""
    r = _Reader(footer)
    try:
        fid, kind = r.field()
        if (fid, kind) != (1, _I32):
            return None
        r.varint()
        fid, kind = r.field(1)
        if (fid, kind) != (2, _LIST):
            return None
        start = r.pos
        r.skip(_LIST, 0)
        schema = footer[start : r.pos]
        fid, kind = r.field(2)
        if (fid, kind) != (3, _I64):
            return None
        rows = r.zigzag()
    except _Bad:
        return None
    return Head(schema, rows) if rows >= 0 else None


def stated_versions(footer: bytes, key: str) -> set[str]:
    """Every value the footer's key-value metadata gives ``key`` (an empty set: none), found by
    the bytes of a ``KeyValue`` holding it (key field, its length, the key, the value field's
    header) instead of a walk past the row groups (the kv list comes after them: a walk costs a
    full parse). A name in the statistics could hold the same bytes only by holding control
    characters; whatever it says is in the set too, so a caller that accepts one value only
    never accepts a footer whose real entry says another."""
    raw = key.encode()
    if len(raw) > 127:
        return set()
    needle = b"\x18" + bytes([len(raw)]) + raw + b"\x18"
    out: set[str] = set()
    at = footer.find(needle)
    while at >= 0:
        r = _Reader(footer)
        r.pos = at + len(needle)
        try:
            n = r.varint()
            r.advance(n)
            out.add(footer[r.pos - n : r.pos].decode("utf-8", "replace"))
        except _Bad:
            out.add("")
        at = footer.find(needle, at + 1)
    return out
