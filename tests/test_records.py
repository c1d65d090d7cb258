"""RECORD and METADATA parsing, where entries live, and a wheel's list of members: the fast paths
agree with the slow ones, and the checks with what zipfile reads."""

from __future__ import annotations

import csv
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env import wheel
from safeinstall.env.distributions import entry_location, metadata_headers
from safeinstall.env.records import PROBLEMS_LIMIT, RecordEntry, RecordHash, count_lines, parse_record
from safeinstall.env.wheel import read_wheel
from safeinstall.errors import WheelError

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
        "//etc/passwd",
        "/",
        "a..b/c",
        "nvidia/cudnn/lib/libcudnn.so.9",
    ],
)
def test_entry_location_is_the_normalised_join(path: str) -> None:
    """As uv takes a RECORD path: a leading "/" is dropped (uv removes site-packages/etc/passwd)."""
    entry = RecordEntry(path, None, None)
    assert entry_location(SITE, entry) == os.path.normpath(os.path.join(SITE, path.lstrip("/")))


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
    first = record.entries[0]  # built without the NamedTuples' own __new__ (records.built): still them
    assert type(first) is RecordEntry and type(first.hash) is RecordHash and first.size == 12
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


def test_lines_end_as_uv_ends_them() -> None:
    """Lines end at "\\r\\n", "\\r" or "\\n" outside quotes, as uv's CSV reader ends them (the files
    safeinstall checks and backs up are the files uv removes): a line that starts with "\\r" names
    the file after it; within quotes a newline or "\\r\\n" is part of the path, as written; what
    str.splitlines also split at ("\\x1c", "\\u2028") is part of the path, as uv reads it."""
    for quote in ("", '"q.py",,\n'):  # the plain split and the csv module
        text = (
            quote + "a.py,sha256=AAAA,1\r\n"
            "\rdemo_top.py,sha256=BBBB,6\n"
            "b\x1cc.py,sha256=CCCC,2\r"
            "d\u2028e.py,,\n"
        )
        paths = [e.path for e in parse_record(text).entries]
        assert paths == ["q.py"] * bool(quote) + ["a.py", "demo_top.py", "b\x1cc.py", "d\u2028e.py"]
        assert parse_record(text).problems == ()
    quoted = '"f\ng.py",sha256=DDDD,3\n"h\r\ni.py",,\n'
    assert [e.path for e in parse_record(quoted).entries] == ["f\ng.py", "h\r\ni.py"]
    assert count_lines(quoted) == 6  # at most: the quoted line ends are not rows of their own


def test_what_would_cost_root_memory_or_raise_is_a_problem() -> None:
    """A size of 5,000 digits made int() raise (an internal error for every verification of the
    environment); a line of commas was a list of as many fields."""
    (problem,) = parse_record("x.py,sha256=AAAA," + "1" * 5000 + "\n").problems
    assert problem.reason.startswith("size '1111") and problem.reason.endswith("is too large")
    (problem,) = parse_record("x.py" + "," * 100_000 + "\n").problems
    assert problem.reason == "expected 3 fields (path,hash,size), found more" and len(problem.text) <= 1024
    (problem,) = parse_record('"x.py"' + "," * 100_000 + "\n").problems
    assert problem.reason == "more than 3 commas a line: not parsed"


def test_a_record_of_more_lines_than_the_limit_is_not_split() -> None:
    record = parse_record("x.py,,\n" * 20, max_lines=10)
    assert record.entries == ()
    (problem,) = record.problems
    assert problem.reason == "more than 10 lines: not parsed"
    assert len(parse_record("x.py,,\n" * 9, max_lines=10).entries) == 9


@pytest.mark.parametrize("trailing", [0, 65_536])
def test_a_wheels_list_of_members_is_bounded_where_zipfile_reads_it(
    trailing: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zipfile reads a wheel's whole central directory in one read and makes an object of each 46-byte
    entry: the read itself is bounded (here to 100 kB), so nothing can differ between a check and
    zipfile's own reading (an end record 65,536 bytes before the end, which it still finds; the file
    rewritten in between)."""
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for n in range(1000):  # a list of about 110 KiB
            archive.writestr(f"demo/a_module_with_a_name_long_enough_to_fill_a_list_{n}.py", b"")
        archive.writestr("demo-1.0.dist-info/METADATA", b"Name: demo\nVersion: 1.0\n")
        archive.writestr("demo-1.0.dist-info/WHEEL", b"Wheel-Version: 1.0\n")
        archive.writestr("demo-1.0.dist-info/RECORD", b"")
    with open(path, "ab") as tail:
        tail.write(bytes(trailing))
    assert len(zipfile.ZipFile(path).infolist()) == 1003  # zipfile reads it
    assert read_wheel(path).name == "demo"
    monkeypatch.setattr(wheel, "CENTRAL_DIRECTORY_LIMIT", 100_000)  # above the end records' 64 KiB
    with pytest.raises(WheelError) as refused:
        read_wheel(path)
    assert refused.value.message.endswith("bytes, more than the 100000 bytes allowed")
    assert "its list of members takes 1" in refused.value.message


def test_a_byte_order_mark_is_dropped_as_uv_drops_it() -> None:
    """uv's CSV reader drops a leading BOM: the first path is "a", as uv removes it, not "\\ufeffa"."""
    for text in ("\ufeffa,,\nb,,\n", '\ufeff"a",,\nb,,\n'):
        record = parse_record(text)
        assert [e.path for e in record.entries] == ["a", "b"] and record.problems == ()


def test_a_read_to_the_end_of_a_wheels_list_reads_at_most_one_byte_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zipfile reads its end records with read() to the end of the file: whatever the file has grown
    to by then (its writer can grow it after any check), at most the bound and one byte are read."""
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with open(path, "wb") as grown:
        grown.truncate(64 << 20)
    monkeypatch.setattr(wheel, "CENTRAL_DIRECTORY_LIMIT", 1000)
    with open(path, "rb") as handle:
        listing = wheel._ListingBounded(handle, path)
        with pytest.raises(WheelError, match="its list of members takes more than the 1000 bytes allowed"):
            listing.read()
        assert handle.tell() == 1001


def test_a_damaged_member_stops_the_hashing_of_the_large_members_not_yet_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small member that fails its CRC (or a Ctrl-C) while the wheel's large members hash on worker
    threads: the error comes once the members already inflating are done, not after every large
    member left (torch: seconds before a Ctrl-C took effect)."""
    from tests import wheelhouse

    files = {"demo/__init__.py": b"x = 1\n" * 100}
    files |= {f"demo/big{n}.bin": os.urandom(4 << 20) for n in range(16)}
    path = wheelhouse.make_wheel(tmp_path, "demo", "1.0", files)
    wheelhouse.corrupt_member(path, "demo/__init__.py")
    opened: list[str] = []
    real_open = zipfile.ZipFile.open

    def open_member(archive: zipfile.ZipFile, name: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(name if isinstance(name, str) else name.filename)
        return real_open(archive, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", open_member)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})  # two workers, whatever the host
    with pytest.raises(WheelError):
        read_wheel(path)
    monkeypatch.undo()
    started = [name for name in opened if name.startswith("demo/big")]
    assert len(started) < len(files) - 1, started


@pytest.mark.parametrize("member", ["demo/__init__.py", "demo/big.bin"])
def test_a_damaged_deflated_member_is_a_wheel_error(tmp_path: Path, member: str) -> None:
    """A deflated member whose data the wheel's owner damaged fails in zlib, not in zipfile: an
    error and a hint about the wheel (exit 2), not an internal error, whether the calling thread or a
    worker inflates it."""
    from tests import wheelhouse

    dist_info = "demo-1.0.dist-info"
    members = {
        "demo/__init__.py": b"x = 1\n" * 1000,
        "demo/big.bin": os.urandom(1 << 20) + b"\0" * (1 << 20),
        f"{dist_info}/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = wheelhouse.write_wheel(tmp_path / "demo-1.0-py3-none-any.whl", members, dist_info, deflate=True)
    wheelhouse.corrupt_member(path, member)
    with pytest.raises(WheelError, match="not a valid zip archive"):
        read_wheel(path)
