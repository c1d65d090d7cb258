"""RECORD files (PEP 376 / the wheel spec), parsed once into typed entries.

Everything else in safeinstall works on :class:`RecordEntry`; nothing re-reads the CSV.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

#: Hash algorithms a RECORD may use; anything weaker (md5, sha1) is refused by the spec.
ACCEPTED_ALGORITHMS = frozenset({"sha256", "sha384", "sha512", "sha3_256", "blake2b"})


class RecordHash(NamedTuple):
    """NamedTuples, not frozen dataclasses, for what there is one of per RECORD line (torch: 12k): a
    frozen dataclass's ``__init__`` sets each field with ``object.__setattr__``, which made building
    them most of a RECORD's parse time."""

    algorithm: str
    digest: str  # urlsafe base64, no padding, as written in RECORD

    def __str__(self) -> str:
        return f"{self.algorithm}={self.digest}"


class RecordEntry(NamedTuple):
    path: str  # as written: relative to the directory holding the .dist-info, "/" separated
    hash: RecordHash | None
    size: int | None


@dataclass(frozen=True, slots=True)
class RecordProblem:
    line: int  # 1-based
    text: str
    reason: str


@dataclass(frozen=True, slots=True)
class Record:
    entries: tuple[RecordEntry, ...]
    problems: tuple[RecordProblem, ...]


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def encode_digest(raw: bytes) -> str:
    """The RECORD spelling of a digest: urlsafe base64 without '=' padding (once per file verified:
    ``binascii`` directly, without ``base64``'s wrappers)."""
    return binascii.b2a_base64(raw, newline=False).rstrip(b"=").translate(_URLSAFE).decode("ascii")


def decode_digest(text: str) -> bytes:
    """The raw digest of its RECORD spelling (padding restored)."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def digest_bytes(data: bytes, algorithm: str = "sha256") -> str:
    return encode_digest(hashlib.new(algorithm, data).digest())


def _parse_row(row: list[str]) -> RecordEntry | str:
    """One CSV row to an entry, or the reason it is malformed."""
    if len(row) != 3:
        return f"expected 3 fields (path,hash,size), found {len(row)}"
    path, hash_text, size_text = row
    if not path:
        return "empty path"
    if "\0" in path:  # no file can be named so; looking it up would raise, not fail
        return "a NUL byte in the path"
    record_hash: RecordHash | None = None
    if hash_text:
        algorithm, sep, digest = hash_text.partition("=")
        if not sep or not digest:
            return f"hash {hash_text!r} is not of the form algorithm=digest"
        if algorithm not in ACCEPTED_ALGORITHMS:
            return f"hash algorithm {algorithm!r} is not accepted"
        record_hash = RecordHash(algorithm, digest)
    size: int | None = None
    if size_text:
        try:
            size = int(size_text)
        except ValueError:
            return f"size {size_text!r} is not an integer"
        if size < 0:
            return f"size {size} is negative"
    return RecordEntry(path=path, hash=record_hash, size=size)


def parse_record(text: str) -> Record:
    """Parse RECORD text. Malformed lines become problems, never exceptions."""
    entries: list[RecordEntry] = []
    problems: list[RecordProblem] = []
    lines = text.splitlines()
    # Without a quote anywhere, CSV is a plain split on commas (and a torch RECORD has 15k lines).
    rows = csv.reader(lines) if '"' in text else (line.split(",") for line in lines)
    accepted = ACCEPTED_ALGORITHMS
    plain = "\0" not in text  # else every line goes through _parse_row, which refuses a NUL in a path
    for number, row in enumerate(rows, start=1):
        if (
            plain and len(row) == 3 and row[0]
        ):  # the usual hashed line, as _parse_row takes it, without a call
            algorithm, _, digest = row[1].partition("=")
            size_text = row[2]
            if digest and algorithm in accepted and size_text.isascii() and size_text.isdigit():
                entries.append(RecordEntry(row[0], RecordHash(algorithm, digest), int(size_text)))
                continue
        if not row or row == [""]:
            continue
        parsed = _parse_row(row)
        if isinstance(parsed, str):
            raw = lines[number - 1] if number - 1 < len(lines) else ",".join(row)
            problems.append(RecordProblem(line=number, text=raw, reason=parsed))
        else:
            entries.append(parsed)
    return Record(entries=tuple(entries), problems=tuple(problems))
