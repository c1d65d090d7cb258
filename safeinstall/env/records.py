"""RECORD files (PEP 376 / the wheel spec), parsed once into typed entries.

Everything else in safeinstall works on :class:`RecordEntry`; nothing re-reads the CSV."""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

#: Hash algorithms a RECORD may use; anything weaker (md5, sha1) is refused by the spec.
ACCEPTED_ALGORITHMS = frozenset({"sha256", "sha384", "sha512", "sha3_256", "blake2b"})


#: Builds a NamedTuple from all its fields, in order: ``tuple.__new__`` without the class's generated
#: ``__new__`` (a Python function that costs as much again), for what is built once per RECORD line or
#: per file verified (torch: 12k each).
built = tuple.__new__


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


#: The most digits of a size (no file is larger than 10**20 bytes).
_SIZE_DIGITS = 20


def _parse_row(row: list[str]) -> RecordEntry | str:
    """One CSV row to an entry, or the reason it is malformed."""
    if len(row) != 3:
        return f"expected 3 fields (path,hash,size), found {len(row) if len(row) < 4 else 'more'}"
    path, hash_text, size_text = row
    if not path:
        return "empty path"
    if "\0" in path:  # no file can be named so; looking it up would raise, not fail
        return "a NUL byte in the path"
    record_hash: RecordHash | None = None
    if hash_text:
        algorithm, sep, digest = hash_text.partition("=")
        if not sep or not digest:
            return f"hash {hash_text[:80]!r} is not of the form algorithm=digest"
        if algorithm not in ACCEPTED_ALGORITHMS:
            return f"hash algorithm {algorithm[:80]!r} is not accepted"
        record_hash = RecordHash(algorithm, digest)
    size: int | None = None
    if size_text:
        if len(size_text) > _SIZE_DIGITS:  # int() refuses over 4,300 digits (ValueError) anyway
            return f"size {size_text[:40]!r}... is too large"
        try:
            size = int(size_text)
        except ValueError:
            return f"size {size_text[:40]!r} is not an integer"
        if size < 0:
            return f"size {size} is negative"
    return RecordEntry(path=path, hash=record_hash, size=size)


#: A RECORD's malformed lines reported one by one; those beyond are counted in one more problem (a
#: RECORD of millions of 2-byte lines must not become millions of problems in root's memory).
PROBLEMS_LIMIT = 100
#: A RECORD of more lines than this is not parsed (one problem says so): each parsed line costs root
#: hundreds of bytes of memory, however short it is (torch's RECORD has 15k lines).
LINES_LIMIT = 1_000_000


def count_lines(text: str) -> int:
    """Pure: how many lines :func:`parse_record` splits ``text`` into, at most (no copy)."""
    return text.count("\n") + text.count("\r") + 1


#: Where a line ends, as uv's CSV reader (Rust's csv crate) and Python's csv module end one outside
#: quotes: "\r\n", "\r" or "\n".
_LINE_END = re.compile("\r\n?|\n")


class _NotCsv(list[str]):
    """What is left of a RECORD once the CSV reader failed: one item, why."""


def _csv_rows(text: str) -> Iterator[list[str]]:
    """The rows of quoted CSV, lines ended as :data:`_LINE_END` says (within quotes they are part of
    the field, "\r\n" as written); where the reader fails (a field over its 128 KiB limit), one
    :class:`_NotCsv` row, and no more."""
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        yield from reader
    except csv.Error as exc:
        yield _NotCsv([f"not CSV from here on ({exc})"])


def parse_record(text: str, max_lines: int = LINES_LIMIT) -> Record:
    r"""Parse RECORD text; malformed lines become problems, never exceptions.

    Lines end at "\r\n", "\r" or "\n" outside quotes, as uv splits them. Over ``max_lines`` lines, or
    quoted with many commas, it is not split at all (one problem): root's memory is bounded."""
    text = text.removeprefix("\ufeff")  # a byte order mark: CSV readers (uv's) drop it
    lines_at_most = count_lines(text)
    if lines_at_most > max_lines:
        return Record((), (RecordProblem(1, "", f"more than {max_lines} lines: not parsed"),))
    quoted = '"' in text
    if quoted and text.count(",") > 3 * lines_at_most + 4096:  # csv makes a field of each
        return Record((), (RecordProblem(1, "", "more than 3 commas a line: not parsed"),))
    entries: list[RecordEntry] = []
    problems: list[RecordProblem] = []
    unlisted = first_unlisted = 0  # malformed lines beyond PROBLEMS_LIMIT, the first of them
    # Without a quote anywhere, CSV is a plain split on commas (and a torch RECORD has 15k lines); a
    # fourth field is not split off (a line of a million commas would be a million fields).
    if quoted:
        rows = _csv_rows(text)
    else:
        lines = _LINE_END.split(text) if "\r" in text else text.split("\n")
        rows = (line.split(",", 3) for line in lines)
    accepted = ACCEPTED_ALGORITHMS
    plain = "\0" not in text  # else every line goes through _parse_row, which refuses a NUL in a path
    for number, row in enumerate(rows, start=1):
        if plain and len(row) == 3 and row[0]:  # the usual hashed line, as _parse_row takes it, uncalled
            algorithm, _, digest = row[1].partition("=")
            size_text = row[2]
            if (
                digest
                and algorithm in accepted
                and size_text.isascii()
                and size_text.isdigit()
                and len(size_text) <= _SIZE_DIGITS
            ):
                entries.append(
                    built(RecordEntry, (row[0], built(RecordHash, (algorithm, digest)), int(size_text)))
                )
                continue
        if not row or row == [""]:
            continue
        parsed = row[0] if isinstance(row, _NotCsv) else _parse_row(row)
        if not isinstance(parsed, str):
            entries.append(parsed)
        elif len(problems) < PROBLEMS_LIMIT:
            raw = ",".join(row)[:1024]
            problems.append(RecordProblem(line=number, text=raw, reason=parsed))
        else:
            first_unlisted = number if not unlisted else first_unlisted
            unlisted += 1
    if unlisted:
        more = f"this and {unlisted - 1} more malformed lines after it, not listed one by one"
        problems.append(RecordProblem(line=first_unlisted, text="", reason=more))
    return Record(entries=tuple(entries), problems=tuple(problems))
