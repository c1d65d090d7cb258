"""The environment's baseline (issue 23): a wheel whose RECORD lies about a member (pynvvideocodec 2.0.4
ships one) is the wheel's fault once safeinstall itself installed it and verified the file against the
wheel's member: ``--verify-only`` (without the wheel) then reports the file as ``wheel-record``, not drift.
Anything else about that file (a local patch, another installer's copy) stays ``modified``; the baseline is
root's, and one its owner could have written is not used.

Real parts: a venv owned by uid 65534 (the service account), a real run as root with the lying wheel,
the environment's owner acting as itself (``setpriv``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from safeinstall.store.baseline import from_dict
from tests import wheelhouse
from tests.beds import NOBODY, ServiceAccountBed, as_nobody, chown_tree
from tests.clirun import Result, run
from tests.wheelhouse import rebuilt

MEMBER = "sicext/serve.py"


def lying(wheel: Path, out: Path, member: str) -> Path:
    """A copy of ``wheel`` whose RECORD says ``member`` is 7 bytes longer, with another digest, than it
    is (what pynvvideocodec 2.0.4's RECORD says of two of its members); uv installs it without a word."""
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out / wheel.name, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = []
                for line in data.decode().splitlines():
                    if line.startswith(member + ","):
                        size = int(line.rsplit(",", 1)[1]) + 7
                        fake = base64.urlsafe_b64encode(hashlib.sha256(b"x").digest()).rstrip(b"=").decode()
                        line = f"{member},sha256={fake},{size}"
                    lines.append(line)
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)
    return out / wheel.name


def _verify(bed: ServiceAccountBed, *extra: str) -> Result:
    return run("sicext", "--verify-only", "--python", str(bed.python), *extra, env=bed.environ())


def _findings(bed: ServiceAccountBed) -> tuple[int, dict[str, dict[str, object]], list[str]]:
    result = _verify(bed, "--json")
    doc = result.json
    found = {os.path.relpath(f["path"], bed.site): f for f in doc["data"]["findings"]}
    return result.code, found, doc["data"]["notes"]


def _owner_writes(bed: ServiceAccountBed, path: Path, data: bytes) -> None:
    """The environment's owner writes ``path`` as itself (with the environment's interpreter)."""
    as_nobody(str(bed.python), "-c", f"open({str(path)!r}, 'wb').write({data!r})")


def test_a_file_the_wheels_record_lies_about_is_wheel_record_after_a_verified_run(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    wheel = lying(account.wheels["sicext-2"], tmp_path / "lying", MEMBER)
    served = account.site / MEMBER
    before = _verify(account, "--json").json
    assert before["exit_code"] == 0 and before["data"]["findings"] == []

    refused = account.cli("sicext", "--wheel", str(wheel), "--yes", "--json").json
    assert refused["exit_code"] == 2 and "--accept-record-mismatch" in refused["errors"][0]["hint"]
    accept = ("--wheel", str(wheel), "--accept-record-mismatch")
    result = account.cli("sicext", *accept, "--yes", "--settle", "0.5", "--json")
    assert result.code == 0, result.stdout + result.stderr
    warnings = result.json["data"]["plan"]["warnings"]
    assert any("the wheel's own RECORD is wrong about 1 member" in w for w in warnings), warnings
    # an account's run cache is the account's: no installed file is taken on its identity (docs/window.md)
    steps = {step["name"]: step["detail"] for step in result.json["data"]["steps"]}
    assert "hashed" not in steps["prefetch"] and "links of the run's cache" not in steps["verify"], steps
    shipped = served.read_bytes()

    # without the baseline, the file is drift: the installed RECORD is the wheel's lie
    (state_dir,) = [p for p in account.state.iterdir() if (p / "prefix").is_file()]
    kept = state_dir / "baseline.json"
    info = kept.stat()
    assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o600  # root's: its owner cannot write it
    with pytest.raises(subprocess.CalledProcessError) as denied:
        _owner_writes(account, kept, b"{}")
    assert "PermissionError" in denied.value.stderr
    (entry,) = json.loads(kept.read_bytes())["distributions"]["sicext"]
    assert entry["version"] == "2.0" and set(entry["files"]) == {str(served)}

    code, found, notes = _findings(account)
    assert code == 0 and notes == [], (found, notes)
    assert set(found) == {MEMBER}
    assert found[MEMBER]["kind"] == "wheel-record" and found[MEMBER]["drift"] is False
    assert found[MEMBER]["baseline"] == "run"
    assert "the wheel's own RECORD is wrong" in str(found[MEMBER]["detail"])
    human = _verify(account)
    assert human.code == 0
    assert "the very bytes safeinstall installed and verified against its wheel" in human.stderr
    assert "wheel-record, not drift" in human.stderr
    plan = account.cli("sicext", *accept, "--dry-run", "--json").json
    assert plan["exit_code"] == 0 and plan["data"]["locally_modified"] == []  # no local change to lose

    # a local patch of that very file is drift
    _owner_writes(account, served, shipped + b"# a local hotfix\n")
    code, found, _ = _findings(account)
    assert code == 1 and found[MEMBER]["kind"] == "modified"
    assert "RECORD may be wrong" not in str(found[MEMBER]["detail"])

    # the bytes the wheel shipped, put back: the wheel's fault again (the baseline vouches for content)
    _owner_writes(account, served, shipped)
    code, found, _ = _findings(account)
    assert code == 0 and found[MEMBER]["kind"] == "wheel-record"

    # a baseline its owner could have written is not believed
    os.chown(kept, NOBODY, NOBODY)
    code, found, notes = _findings(account)
    assert code == 1 and found[MEMBER]["kind"] == "modified"
    assert len(notes) == 1 and "was not used" in notes[0] and "owned by uid 65534" in notes[0], notes
    os.chown(kept, 0, 0)

    # another installer changed the distribution (the same version, another build): the baseline is stale
    other = rebuilt(wheel, tmp_path / "other", {MEMBER: shipped + b"# another build\n"})
    wheelhouse.uv_install(account.python, other, link_mode="copy", reinstall=True)
    chown_tree(account.site, NOBODY)
    # its own RECORD is true, but it is not the RECORD root found (issue 46): the same version's RECORD
    # rewritten by no safeinstall run is said, as an owner's rewrite would be
    code, found, _ = _findings(account)
    assert code == 1 and found[MEMBER]["kind"] == "record-changed", found
    _owner_writes(account, served, shipped)  # the owner puts the first build's bytes back
    code, found, _ = _findings(account)
    assert code == 1 and found[MEMBER]["kind"] in ("modified", "record-changed"), found


def test_a_baseline_is_checked_when_read() -> None:
    entry = {
        "version": "2.0",
        "dist_info": "/v/lib/python3.11/site-packages/sicext-2.0.dist-info",
        "record": "ab" * 32,
        "run_id": "20261202T060000Z-42",
        "wheel": "sicext-2.0-cp311-cp311-linux_x86_64.whl",
        "files": {"/v/lib/python3.11/site-packages/sicext/serve.py": "sha256=abc:12"},
    }
    good = {"baseline_version": 1, "prefix": "/v", "distributions": {"sicext": [entry]}}
    assert from_dict(good, "/v").distributions["sicext"][0].files == entry["files"]
    with pytest.raises(ValueError, match="not of /w"):
        from_dict(good, "/w")  # another environment's
    for field, value in [
        ("run_id", "../../etc"),
        ("files", {"relative/serve.py": "sha256=abc:12"}),
        ("files", {"/v/a/../../etc/passwd": "sha256=abc:12"}),
        ("files", {"/v/x.py": "absent"}),  # it vouches only for a regular file's content
        ("dist_info", "relative.dist-info"),
        ("version", ""),
    ]:
        with pytest.raises(ValueError):
            from_dict({**good, "distributions": {"sicext": [{**entry, field: value}]}}, "/v")
    with pytest.raises(ValueError, match="1 to 5 entries"):
        from_dict({**good, "distributions": {"sicext": [entry] * 6}}, "/v")


def test_only_the_wheels_own_bytes_are_vouched_for() -> None:
    """What a run keeps is a file that holds exactly the wheel's member and that the RECORD does not
    describe: not a file changed after the verification (or a script whose first line the installer
    wrote), nor one the RECORD describes."""
    from safeinstall.env.distributions import InstalledDistribution
    from safeinstall.env.hashing import FileState
    from safeinstall.env.records import Record, RecordEntry, RecordHash
    from safeinstall.env.vouched import file_key, vouched_of

    site = "/v/lib/python3.11/site-packages"
    entries = (
        RecordEntry("p/lies.py", RecordHash("sha256", "LIE"), 9),
        RecordEntry("p/true.py", RecordHash("sha256", "TRUE"), 4),
        RecordEntry("p/changed.py", RecordHash("sha256", "LIE2"), 9),
    )
    dist = InstalledDistribution(
        "p",
        "p",
        "1.0",
        Path(site),
        Path(f"{site}/p-1.0.dist-info"),
        Record(entries, ()),
        (),
        "uv",
        tuple(f"{site}/{e.path}" for e in entries),
    )
    observed = {
        f"{site}/p/lies.py": FileState(f"{site}/p/lies.py", True, True, 8, "REAL", "sha256"),
        f"{site}/p/true.py": FileState(f"{site}/p/true.py", True, True, 4, "TRUE", "sha256"),
        f"{site}/p/changed.py": FileState(f"{site}/p/changed.py", True, True, 8, "EVIL", "sha256"),
    }
    shipped = {
        loc: "sha256=REAL:8" if "lies" in loc or "changed" in loc else file_key(s)
        for loc, s in observed.items()
    }
    vouched = vouched_of(dist, observed, shipped, "20261202T060000Z-1", "p-1.0-py3-none-any.whl")
    assert vouched is not None and dict(vouched.files) == {f"{site}/p/lies.py": "sha256=REAL:8"}
    assert vouched_of(dist, observed, {}, "20261202T060000Z-1", "p.whl") is None


def test_an_undo_back_to_a_version_whose_wheels_record_lies_verifies_against_the_baseline(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    """The baseline keeps each version's entry: a run away from the lying version, then ``--undo``
    back to it, verifies the restored files as the first run did (they are the wheel's bytes), where
    the installed RECORD alone would fail the undo and roll it back."""
    wheel = lying(account.wheels["sicext-2"], tmp_path / "lying", MEMBER)
    first = account.cli(
        "sicext", "--wheel", str(wheel), "--accept-record-mismatch", "--yes", "--settle", "0.5"
    )
    assert first.code == 0, first.stdout + first.stderr
    back = account.cli("sicext", "--wheel", str(account.wheels["sicext-1"]), "--yes", "--settle", "0.5")
    assert back.code == 0, back.stdout + back.stderr
    assert _findings(account)[0] == 0  # 1.0's RECORD is true
    undo = account.cli("--undo", "--yes", "--settle", "0.5", "--json")
    assert undo.code == 0, undo.stdout + undo.stderr
    code, found, _ = _findings(account)
    assert code == 0 and found[MEMBER]["kind"] == "wheel-record"


def test_a_baseline_nested_too_deep_is_damaged_not_a_crash(tmp_path: Path) -> None:
    """JSON nested deeper than the parser goes raises RecursionError, not ValueError: it is said as a
    damaged baseline like any other (ignored by --verify-only, written over after a good run)."""
    from safeinstall.store.baseline import BASELINE_NAME, load_baseline
    from safeinstall.store.state import EnvironmentState

    state = EnvironmentState(tmp_path.parent, tmp_path, Path("/v"))
    (tmp_path / BASELINE_NAME).write_bytes(b"[" * 200_000 + b"]" * 200_000)
    os.chmod(tmp_path / BASELINE_NAME, 0o600)
    with pytest.raises(ValueError, match="nested too deep"):
        load_baseline(state, "/v")
