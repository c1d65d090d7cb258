"""--keep-patches: local patches carried over to the new version by a three-way merge.

The merge itself on small texts; then end to end with real fixture wheels of two versions: sicext 1.0
and 2.0 share ``serve.py`` and the end of ``__init__.py``, and differ in ``__init__.py``'s first line
and the extension; 3.0 has no ``serve.py``; 4.0 crashes on import but keeps 1.0's ``serve.py``. The
service (a unit of the private user manager running the venv's python) writes a marker file from the
patched code, so what runs after the restart is seen from the outside.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from safeinstall.env.owner import write_carried
from safeinstall.env.records import digest_bytes
from safeinstall.errors import StepFailed
from safeinstall.run.parts.patches import (
    LocalPatch,
    PatchOutcome,
    PatchSet,
    PatchStatus,
    Versions,
    merge_file,
    settle,
)
from tests.bed_systemd import wait_until
from tests.beds import Bed
from tests.clirun import SAFEINSTALL, run

V = Versions("pkg", "1.0", "2.0")
BASE = b"".join(f"line {n}\n".encode() for n in range(1, 21))


def _edit(text: bytes, old: bytes, new: bytes) -> bytes:
    assert old in text
    return text.replace(old, new)


def _patch(base: bytes | None, ours: bytes | None, theirs: bytes | None, problem: str = "") -> LocalPatch:
    return LocalPatch(
        "/venv/lib/site-packages/pkg/mod.py", "lib/site-packages/pkg/mod.py", base, ours, theirs, problem
    )


# ---------------------------------------------------------------------------------------------- the merge


def test_a_patch_away_from_the_new_versions_changes_is_merged_into_them() -> None:
    ours = _edit(BASE, b"line 3\n", b"line 3 patched\n")
    theirs = _edit(BASE, b"line 15\n", b"line 15 upstream\n")
    outcome = merge_file(_patch(BASE, ours, theirs), V)
    assert outcome.status is PatchStatus.CARRIED and outcome.detail == "merged"
    assert outcome.merged == _edit(theirs, b"line 3\n", b"line 3 patched\n")
    assert "-line 3\n+line 3 patched\n" in outcome.diff and "upstream" not in outcome.diff


def test_line_endings_and_a_missing_final_newline_come_through_unchanged() -> None:
    base = BASE.replace(b"\n", b"\r\n").rstrip(b"\r\n")
    ours = _edit(base, b"line 2\r\n", b"line 2 patched\r\n")
    theirs = _edit(base, b"line 20", b"line 20 upstream")
    outcome = merge_file(_patch(base, ours, theirs), V)
    assert outcome.merged == _edit(theirs, b"line 2\r\n", b"line 2 patched\r\n")


def test_a_patch_of_lines_the_new_version_changed_is_a_conflict_shown_with_both_sides() -> None:
    ours = _edit(BASE, b"line 10\n", b"line 10 patched\n")
    theirs = _edit(BASE, b"line 10\n", b"line 10 upstream\n")
    outcome = merge_file(_patch(BASE, ours, theirs), V)
    assert outcome.status is PatchStatus.CONFLICT and outcome.merged is None
    assert "the local patch and pkg 2.0 change the same lines" in outcome.detail
    for line in (
        "+<<<<<<< local patch",
        "+line 10 patched",
        "+||||||| pkg 1.0",
        "+=======",
        "+>>>>>>> pkg 2.0",
    ):
        assert line + "\n" in outcome.diff
    assert outcome.diff.startswith("--- a/lib/site-packages/pkg/mod.py\n+++ b/lib/site-packages/pkg/mod.py\n")


def test_a_patch_the_new_version_already_has_is_carried_as_it_is() -> None:
    ours = theirs = _edit(BASE, b"line 4\n", b"line 4 fixed\n")
    outcome = merge_file(_patch(BASE, ours, theirs), V)
    assert outcome.status is PatchStatus.CARRIED and outcome.merged == theirs and outcome.diff == ""
    assert outcome.detail == "2.0 already has this change"


@pytest.mark.parametrize(
    ("patch", "detail"),
    [
        (_patch(b"\x7fELF\0\x01", b"\x7fELF\0\x02", b"\x7fELF\0\x03"), "binary file"),
        (_patch(BASE, BASE + b"local\n", None), "pkg 2.0 no longer has this file"),
        (_patch(BASE, None, BASE), "deleted locally"),
        (_patch(None, BASE, BASE, problem="outside site-packages"), "outside site-packages"),
    ],
    ids=["binary", "gone-upstream", "deleted", "outside"],
)
def test_what_cannot_be_merged_is_a_conflict(patch: LocalPatch, detail: str) -> None:
    outcome = merge_file(patch, V)
    assert outcome.status is PatchStatus.CONFLICT and detail in outcome.detail and outcome.merged is None


def test_drop_conflicting_drops_what_cannot_be_carried_and_keeps_the_rest() -> None:
    carried = PatchOutcome("/b", PatchStatus.CARRIED, "merged", "diff b\n", b"b")
    conflict = PatchOutcome("/a", PatchStatus.CONFLICT, "binary file")
    assert settle([carried, conflict], drop_conflicting=False) == (conflict, carried)
    kept = PatchSet(V, settle([carried, conflict], drop_conflicting=True), "base.whl")
    assert [o.status for o in kept.outcomes] == [PatchStatus.DROPPED, PatchStatus.CARRIED]
    assert kept.refusal() is None and kept.patch_text() == "diff b\n"
    assert kept.expected()["/b"].digest == digest_bytes(b"b") and set(kept.expected()) == {"/b"}
    refused = PatchSet(V, settle([carried, conflict], drop_conflicting=False)).refusal()
    assert refused is not None and refused.exit_code == 2 and "/a: binary file" in refused.message
    assert "--drop-conflicting" in (refused.hint or "")


# ---------------------------------------------------------------------------------------------- the write


def test_the_merged_file_replaces_the_installed_one_atomically_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "lib" / "pkg" / "mod.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"new version\n")
    target.chmod(0o640)
    write_carried(tmp_path, str(target), b"merged\n")
    assert target.read_bytes() == b"merged\n" and (target.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in target.parent.iterdir()) == ["mod.py"]


def test_the_write_follows_no_symlink_below_the_prefix(tmp_path: Path) -> None:
    prefix, outside = tmp_path / "prefix", tmp_path / "outside"
    (prefix / "lib").mkdir(parents=True)
    outside.mkdir()
    victim = outside / "victim.py"
    victim.write_bytes(b"not ours\n")
    (prefix / "lib" / "mod.py").symlink_to(victim)  # the final component is a link
    (prefix / "lib" / "pkg").symlink_to(outside, target_is_directory=True)  # a directory is a link
    for location in (prefix / "lib" / "mod.py", prefix / "lib" / "pkg" / "victim.py"):
        with pytest.raises(StepFailed, match="could not write the merged"):
            write_carried(prefix, str(location), b"merged\n")
    with pytest.raises(StepFailed, match="not inside"):
        write_carried(prefix, str(victim), b"merged\n")
    assert victim.read_bytes() == b"not ours\n" and sorted(os.listdir(outside)) == ["victim.py"]
    assert sorted(os.listdir(prefix / "lib")) == ["mod.py", "pkg"]


def test_the_local_version_is_read_through_no_symlink_below_the_prefix(tmp_path: Path) -> None:
    """The environment's owner makes the package directory a symlink into a directory only root may
    read: the "local version" of a file there is not read (so never diffed, merged or written back)."""
    from safeinstall.run.parts.patches import read_regular

    prefix, secret = tmp_path / "prefix", tmp_path / "root-only"
    (prefix / "lib").mkdir(parents=True)
    secret.mkdir(mode=0o700)
    (secret / "mod.py").write_bytes(b"root's secret\n")
    (prefix / "lib" / "pkg").symlink_to(secret, target_is_directory=True)
    (prefix / "lib" / "own.py").write_bytes(b"the package's own\n")
    (prefix / "lib" / "fifo.py").parent.mkdir(exist_ok=True)
    os.mkfifo(prefix / "lib" / "fifo.py")
    assert read_regular(prefix, str(prefix / "lib" / "pkg" / "mod.py")) is None
    assert read_regular(prefix, str(secret / "mod.py")) is None  # outside the prefix
    assert read_regular(prefix, str(prefix / "lib" / "fifo.py")) is None  # never waited on
    assert read_regular(prefix, str(prefix / "lib" / "own.py")) == b"the package's own\n"


# ---------------------------------------------------------------------------------------------- end to end

SERVING = '        print(f"sicext {sicext.version()} serving", flush=True)\n'
V1_FIRST_LINE = '"""Fixture package sicext, version 1: the version comes from the C extension."""\n'
V2_FIRST_LINE = '"""Fixture package sicext, version 2: the version comes from the C extension."""\n'


def _patch_serve(bed: Bed, marker: Path) -> bytes:
    """The shared region: serve.py writes the running version and the patch's mark to ``marker``."""
    serve = bed.site / "sicext" / "serve.py"
    line = (
        f'        open({str(marker)!r}, "w").write(sicext.version() + getattr(sicext, "PATCH", " patched"))\n'
    )
    serve.write_text(serve.read_text().replace(SERVING, SERVING + line))
    return serve.read_bytes()


def _append_to_init(bed: Bed) -> None:
    """The end of __init__.py: shared by 1.0 and 2.0, whose first lines differ."""
    init = bed.site / "sicext" / "__init__.py"
    init.write_text(init.read_text() + 'PATCH = " with a local fix"\n')


def _read(marker: Path) -> str:
    try:
        return marker.read_text()
    except OSError:
        return ""


def _find_links(bed: Bed, tmp_path: Path) -> tuple[str, ...]:
    """uv arguments for a flat index of the fixture wheels, no network."""
    links = tmp_path / "links"
    links.mkdir()
    for key in ("sicext-1", "sicext-2"):
        shutil.copy(bed.wheels[key], links)
    return ("--", "--offline", "--find-links", str(links))


@pytest.mark.parametrize("source", ["base-wheel", "fetched-base", "fetched-both"])
def test_a_patch_in_a_region_both_versions_share_is_carried_and_runs_after_the_restart(
    bed: Bed, tmp_path: Path, source: str
) -> None:
    """The pristine 1.0 from --base-wheel, or fetched by uv from a flat index of the fixture wheels (and
    with the requirement sicext==2.0 instead of --wheel, the new version's files fetched the same way)."""
    marker = tmp_path / "marker"
    _patch_serve(bed, marker)
    _append_to_init(bed)
    bed.service("carry")
    wait_until(lambda: _read(marker) == "1.0 with a local fix", 15, "the patched 1.0 service")
    v2 = bed.wheels["sicext-2"]
    new = ("sicext==2.0",) if source == "fetched-both" else ("sicext", "--wheel", str(v2))
    where = (
        ("--base-wheel", str(bed.wheels["sicext-1"]))
        if source == "base-wheel"
        else _find_links(bed, tmp_path)
    )
    result = bed.safeinstall(*new, "--keep-patches", "--settle", "0.5", "--json", *where)

    assert result.code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert [(s["name"], s["status"]) for s in data["steps"][:3]] == [
        ("preflight", "ok"),
        ("patches", "ok"),
        ("backup", "ok"),
    ]
    init, serve = bed.site / "sicext" / "__init__.py", bed.site / "sicext" / "serve.py"
    assert [(p["path"], p["status"]) for p in data["patches"]] == [
        (str(init), "carried"),
        (str(serve), "carried"),
    ]
    # The restarted service runs 2.0 with both patches (the __init__ one merged next to 2.0's new line).
    wait_until(lambda: _read(marker) == "2.0 with a local fix", 15, "the patched 2.0 service")
    assert init.read_text().startswith(V2_FIRST_LINE) and init.read_text().endswith(
        'PATCH = " with a local fix"\n'
    )
    # --verify-only reports them as modified (they are), and nothing else.
    drift = [(f["path"], f["kind"]) for f in bed.verify().json["data"]["findings"] if f["drift"]]
    assert drift == [(str(init), "modified"), (str(serve), "modified")]
    # The patch set kept in the state directory is what --verify-only --wheel NEW --save-patch writes.
    saved = Path(data["patch_file"])
    assert saved.is_relative_to(bed.state) and saved.read_text().count("+++ b/") == 2
    again = tmp_path / "again.patch"
    assert bed.verify("--wheel", str(v2), "--save-patch", str(again)).code == 1
    assert again.read_text() == saved.read_text()
    assert not any(bed.state.glob("*/keep-patches-*"))  # the scratch directory of the fetches is gone


def test_a_patch_in_a_region_the_new_version_changed_is_refused_before_the_stop(
    bed: Bed, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    _patch_serve(bed, marker)
    init, serve = bed.site / "sicext" / "__init__.py", bed.site / "sicext" / "serve.py"
    init.write_text(init.read_text().replace(V1_FIRST_LINE, '"""sicext 1.0 with a local docstring."""\n'))
    name = bed.service("conflict")
    main = bed.manager.main_pid(name)
    args = ("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--keep-patches", "--settle", "0.5")
    base = ("--base-wheel", str(bed.wheels["sicext-1"]))

    refused = bed.safeinstall(*args, *base)

    assert refused.code == 2, refused.stdout + refused.stderr
    assert (
        "error: --keep-patches: 1 local patch(es) of sicext cannot be carried from 1.0 to 2.0"
        in refused.stderr
    )
    assert f"conflict {init}: the local patch and sicext 2.0 change the same lines" in refused.stdout
    for line in ("<<<<<<< local patch", '+"""sicext 1.0 with a local docstring."""', ">>>>>>> sicext 2.0"):
        assert line in refused.stdout  # the conflict, shown as a diff against 2.0's file
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    assert not any(bed.state.glob("*/journal.json")) and not any(bed.state.glob("*/keep-patches-*"))
    as_json = bed.safeinstall(*args, *base, "--json").json["data"]
    assert [(p["path"], p["status"]) for p in as_json["patches"]] == [
        (str(init), "conflict"),
        (str(serve), "carried"),
    ]
    assert [(s["name"], s["status"]) for s in as_json["steps"]] == [
        ("preflight", "ok"),
        ("patches", "failed"),
    ]

    dropped = bed.safeinstall(*args, *base, "--drop-conflicting")

    assert dropped.code == 0, dropped.stdout + dropped.stderr
    assert f"dropped {init}" in dropped.stdout and f"carried {serve}" in dropped.stdout
    assert init.read_text().startswith(V2_FIRST_LINE)  # 2.0's file, the local docstring dropped
    wait_until(lambda: _read(marker) == "2.0 patched", 15, "the patched 2.0 service")


@pytest.mark.parametrize("case", ["patched-so", "gone-upstream"])
def test_a_patched_extension_or_a_file_the_new_version_lacks_is_refused(
    bed: Bed, tmp_path: Path, case: str
) -> None:
    name = bed.service(f"refused-{case}")
    main = bed.manager.main_pid(name)
    if case == "patched-so":  # a new inode: the running service keeps the one it mapped
        so, new = bed.so, bed.so.with_suffix(".new")
        new.write_bytes(so.read_bytes() + b"\0local build\0")
        new.replace(so)
        target, path, detail = "sicext-2", so, "binary file"
    else:
        path = bed.site / "sicext" / "serve.py"
        _patch_serve(bed, tmp_path / "marker")
        target, detail = "sicext-3", "sicext 3.0 no longer has this file"
    result = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels[target]),
        "--keep-patches",
        "--base-wheel",
        str(bed.wheels["sicext-1"]),
        "--json",
    )
    assert result.code == 2, result.stdout + result.stderr
    (patch,) = result.json["data"]["patches"]
    assert patch["path"] == str(path) and patch["status"] == "conflict" and detail in patch["detail"]
    assert result.json["errors"][0]["code"] == "patch-conflict"
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"


def test_a_dry_run_makes_the_runs_patch_merge_and_refuses_exactly_when_the_run_would(
    bed: Bed, tmp_path: Path
) -> None:
    """--keep-patches --dry-run: the run's own merge (the pristine files fetched into a private temporary
    directory: nothing in the state directory), listed in the plan; a conflict refuses as the run does."""
    _patch_serve(bed, tmp_path / "marker")
    _append_to_init(bed)
    init, serve = bed.site / "sicext" / "__init__.py", bed.site / "sicext" / "serve.py"
    args = ("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--keep-patches")

    carried = bed.safeinstall(*args, "--dry-run", "--json", *_find_links(bed, tmp_path))

    assert carried.code == 0, carried.stdout + carried.stderr
    assert carried.json["status"] == "would-proceed"
    assert [(p["path"], p["status"]) for p in carried.json["data"]["patches"]] == [
        (str(init), "carried"),
        (str(serve), "carried"),
    ]
    assert not bed.state.exists()  # the dry-run created nothing, not even the state directory

    init.write_text(init.read_text().replace(V1_FIRST_LINE, '"""sicext 1.0 with a local docstring."""\n'))
    base = ("--base-wheel", str(bed.wheels["sicext-1"]))
    refused = bed.safeinstall(*args, *base, "--dry-run", "--json")
    run_refused = bed.safeinstall(*args, *base, "--json")

    assert (refused.code, run_refused.code) == (2, 2), refused.stdout + refused.stderr
    assert refused.json["status"] == "would-refuse"
    assert refused.json["data"]["refusals"] == [run_refused.json["errors"][0]["message"]]
    assert refused.json["data"]["patches"] == run_refused.json["data"]["patches"]
    assert [(p["path"], p["status"]) for p in refused.json["data"]["patches"]] == [
        (str(init), "conflict"),
        (str(serve), "carried"),
    ]
    human = bed.safeinstall(*args, *base, "--dry-run")
    assert human.code == 2 and f"conflict {init}: the local patch and sicext 2.0 change the same lines" in (
        human.stdout
    )
    dropped = bed.safeinstall(*args, *base, "--drop-conflicting", "--dry-run", "--json")
    assert dropped.code == 0, dropped.stdout + dropped.stderr
    assert [p["status"] for p in dropped.json["data"]["patches"]] == ["dropped", "carried"]
    assert bed.version() == "1.0"


def test_the_ansible_modules_check_mode_with_keep_patches_is_the_dry_run_of_the_merge(
    bed: Bed, tmp_path: Path
) -> None:
    """The reinstall module in check mode (``--dry-run`` with ``--keep-patches``, as the play asks) runs
    and reports the merge; it was refused as a usage error."""
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
        parse_result,
        reinstall_argv,
        reinstall_outcome,
    )

    _patch_serve(bed, tmp_path / "marker")
    links = _find_links(bed, tmp_path)[-1]
    params = {"name": "sicext", "wheel": str(bed.wheels["sicext-2"]), "python": str(bed.python)}
    argv = reinstall_argv([SAFEINSTALL], {**params, "user": True, "keep_patches": True}, check_mode=True)
    assert "--dry-run" in argv and "--keep-patches" in argv
    env = {**bed.environ(), "UV_FIND_LINKS": links, "UV_OFFLINE": "1"}  # the base fetched by uv
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    outcome = reinstall_outcome(done.returncode, parse_result(done.stdout), done.stderr, check_mode=True)
    assert (outcome.failed, outcome.status) == (False, "would-proceed"), done.stdout + done.stderr
    result = parse_result(done.stdout)
    assert result is not None
    assert [(p["path"], p["status"]) for p in result["data"]["patches"]] == [
        (str(bed.site / "sicext" / "serve.py"), "carried")
    ]


def test_without_an_index_or_a_base_wheel_the_run_is_refused_clearly(bed: Bed, tmp_path: Path) -> None:
    _patch_serve(bed, tmp_path / "marker")
    v2 = str(bed.wheels["sicext-2"])
    env = {**bed.environ(), "UV_CACHE_DIR": str(tmp_path / "empty-cache")}
    ours = ("--user", "--python", str(bed.python), "--yes", "sicext", "--wheel", v2, "--keep-patches")
    offline = run(*ours, "--", "--offline", env=env)
    assert offline.code == 2, offline.stdout + offline.stderr
    assert "error: --keep-patches cannot get the pristine files of the installed sicext 1.0" in offline.stderr
    assert "uv could not fetch sicext==1.0" in offline.stderr and "hint: pass --base-wheel" in offline.stderr
    wrong = run(*ours, "--base-wheel", v2, env=env)
    assert wrong.code == 2 and "is sicext 2.0; the installed version is sicext 1.0" in wrong.stderr
    assert bed.version() == "1.0" and "Traceback" not in offline.stderr + wrong.stderr
    usage = run("sicext", "--wheel", v2, "--drop-conflicting", env=env)
    assert (
        usage.code == 2
        and "error: --base-wheel and --drop-conflicting go with --keep-patches" in usage.stderr
    )


def test_a_crashing_new_version_is_rolled_back_with_the_local_patches(bed: Bed, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    patched = _patch_serve(bed, marker)
    name = bed.service("crash-patched")
    wait_until(lambda: _read(marker) == "1.0 patched", 15, "the patched 1.0 service")
    marker.unlink()
    result = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-4"]),
        "--keep-patches",
        "--base-wheel",
        str(bed.wheels["sicext-1"]),
        "--settle",
        "1",
        "--json",
        "--no-smoke",
    )
    assert result.code == 3, result.stdout + result.stderr
    data = result.json["data"]
    assert [p["status"] for p in data["patches"]] == ["rolled-back"] and data["patch_file"] is None
    assert "the run rolled back" in data["patches"][0]["detail"]
    assert "restored the previous installation" in result.json["errors"][0]["message"]
    assert (bed.site / "sicext" / "serve.py").read_bytes() == patched
    wait_until(lambda: _read(marker) == "1.0 patched", 15, "the restarted service runs 1.0 with its patch")
    assert bed.manager.active_state(name) == "active"
    drift = [(f["path"], f["kind"]) for f in bed.verify().json["data"]["findings"] if f["drift"]]
    assert drift == [(str(bed.site / "sicext" / "serve.py"), "modified")]
