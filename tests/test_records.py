"""RECORD and METADATA parsing, where entries live, and a wheel's list of members: the fast paths
agree with the slow ones, and the checks with what zipfile reads."""

from __future__ import annotations

import csv
import os
import zipfile
from pathlib import Path

import pytest

from safeinstall.distributions import entry_location, metadata_headers
from safeinstall.records import PROBLEMS_LIMIT, RecordEntry, RecordHash, count_lines, parse_record
from safeinstall.wheel import central_directory_size

SITE = "/srv/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    "path",
    [
        "torch/__init__.py",
        "torch/lib/libtorch_cpu.so",
        "../../../bin/torchrun",
        "./torch/x.py",
        "torch/./x.py",
        "torch//x.py",
        "torch/../evil.py",
        "torch/sub/..",
        ".hidden/x",
        "torch/.hidden",
        "torch/x.py/",
        "/etc/passwd",
        "a..b/c",
        "nvidia/cudnn/lib/libcudnn.so.9",
    ],
)
def test_entry_location_is_the_normalised_join(path: str) -> None:
    entry = RecordEntry(path, None, None)
    assert entry_location(SITE, entry) == os.path.normpath(os.path.join(SITE, path))


def _reference(text: str) -> list[list[str]]:
    return [row for row in csv.reader(text.splitlines()) if row and row != [""]]


def test_record_without_quotes_parses_as_csv_does() -> None:
    text = (
        "pkg/__init__.py,sha256=AAAA,12\n"
        "pkg/x y.py,sha256=BBBB,0\n"
        "\n"
        "pkg-1.0.dist-info/RECORD,,\n"
        "pkg/__pycache__/x.cpython-311.pyc,,\n"
        "too,many,fields,here\n"
    )
    record = parse_record(text)
    assert [e.path for e in record.entries] == [row[0] for row in _reference(text)][:4]
    assert record.entries[0] == RecordEntry("pkg/__init__.py", RecordHash("sha256", "AAAA"), 12)
    assert record.entries[2] == RecordEntry("pkg-1.0.dist-info/RECORD", None, None)
    (problem,) = record.problems
    assert problem.line == 6 and "expected 3 fields" in problem.reason


def test_quoted_paths_go_through_csv() -> None:
    text = '"pkg/a,b.py",sha256=AAAA,1\npkg/c.py,sha256=BBBB,2\n'
    assert [e.path for e in parse_record(text).entries] == ["pkg/a,b.py", "pkg/c.py"]


def test_a_nul_byte_in_a_path_is_a_problem_quoted_or_not() -> None:
    for text in (
        '"pkg/a\0b.py",sha256=AAAA,1\npkg/c.py,sha256=BBBB,2\n',
        "pkg/a\0b.py,sha256=AAAA,1\npkg/c.py,sha256=BBBB,2\n",
    ):
        record = parse_record(text)
        assert [e.path for e in record.entries] == ["pkg/c.py"]
        (problem,) = record.problems
        assert problem.line == 1 and "NUL" in problem.reason


def test_metadata_headers_stop_at_the_body_and_skip_folded_lines() -> None:
    text = (
        "Metadata-Version: 2.1\n"
        "name: torch\n"
        "Summary: Tensors and\n"
        "  Version: 9.9 (a folded line, not a header)\n"
        "Version: 2.13.0\n"
        "Version: 3.0\n"
        "\n"
        "Name: not-this\n"
    )
    assert metadata_headers(text, ("Name", "Version")) == {"Name": "torch", "Version": "2.13.0"}
    assert metadata_headers("Name: x\n", ("Name", "Version")) == {"Name": "x"}


def test_malformed_lines_beyond_the_limit_are_one_problem() -> None:
    """A RECORD of a million 2-byte lines costs root one problem per line up to PROBLEMS_LIMIT, then
    one more that counts the rest (they were each an object holding its line)."""
    text = "ok.py,sha256=abc,3\n" + "x\n" * 250 + "ok2.py,,\n" + "y\n" * 5
    record = parse_record(text)
    assert [e.path for e in record.entries] == ["ok.py", "ok2.py"]
    assert len(record.problems) == PROBLEMS_LIMIT + 1
    assert [p.line for p in record.problems[:PROBLEMS_LIMIT]] == list(range(2, PROBLEMS_LIMIT + 2))
    last = record.problems[-1]
    assert last.line == PROBLEMS_LIMIT + 2
    assert last.reason == "this and 154 more malformed lines after it, not listed one by one"


def test_a_field_over_the_csv_limit_is_a_problem_not_an_exception() -> None:
    """A quoted path over csv's 128 KiB field limit made parsing raise (every --verify-only of the
    environment, and every run's preflight, ended with an internal error)."""
    text = 'ok.py,sha256=AAAA,1\n"' + "a" * 200_000 + '",sha256=BBBB,2\n'
    record = parse_record(text)
    assert [e.path for e in record.entries] == ["ok.py"]
    (problem,) = record.problems
    assert problem.line == 2 and problem.reason.startswith("not CSV from here on (field larger than")


def test_lines_end_at_newline_as_csv_and_uv_split_them() -> None:
    """ "\\r\\n" ends a line; other characters str.splitlines splits at ("\\x1c", "\\u2028") are part of
    the path, as uv's CSV reader takes them; a quoted path may hold a newline."""
    text = 'a.py,sha256=AAAA,1\r\nb\x1cc.py,sha256=BBBB,2\nd\u2028e.py,,\n"f\ng.py",sha256=CCCC,3\n'
    paths = [e.path for e in parse_record(text).entries]
    assert paths == ["a.py", "b\x1cc.py", "d\u2028e.py", "f\ng.py"]
    assert count_lines(text) == 6  # at most: the quoted newline is not a row of its own


def test_a_record_of_more_lines_than_the_limit_is_not_split() -> None:
    record = parse_record("x.py,,\n" * 20, max_lines=10)
    assert record.entries == ()
    (problem,) = record.problems
    assert problem.reason == "more than 10 lines: not parsed"
    assert len(parse_record("x.py,,\n" * 9, max_lines=10).entries) == 9


@pytest.mark.parametrize(
    "kind", ["plain", "comment", "comment-with-signature", "comment-with-record", "zip64"]
)
def test_the_central_directory_size_is_read_as_zipfile_reads_it(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel's list of members is bounded before zipfile reads it: the size checked must be the one
    zipfile will use (a comment can hold an end record's signature; zip64 archives have two records)."""
    path = tmp_path / "x.zip"
    if kind == "zip64":  # zipfile writes zip64 end records past this many entries
        monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 3)
    with zipfile.ZipFile(path, "w") as archive:
        for n in range(5):
            archive.writestr(f"pkg/m{n}.py", b"x" * n)
        if kind.startswith("comment"):
            archive.comment = (
                b"a comment"
                + {
                    "comment": b"",
                    "comment-with-signature": b"PK\x05\x06",  # too short for a record: not a zip
                    "comment-with-record": b"PK\x05\x06" + bytes(range(1, 19)),  # zipfile takes this one
                }[kind]
            )
    with open(path, "rb") as handle:
        end = zipfile._EndRecData(handle)  # type: ignore[attr-defined]
        theirs = None if end is None else end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
        assert central_directory_size(handle) == theirs
        assert (theirs is None) == (kind == "comment-with-signature")
    assert (kind == "zip64") == (b"PK\x06\x06" in path.read_bytes())
