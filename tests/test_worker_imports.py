"""Workers never import (issue 35): every entry point that runs as an account works from a safeinstall
whose interpreter, standard library and own files the account cannot read (below a 0700 directory, as
``uv tool install`` under a pyenv in ``/root`` has them).

A forked worker is a copy of root's process that changes its uid: whatever it imports after that is
read as the account. ``open(..., encoding="ascii")`` in :mod:`safeinstall.system.safefs` loaded the
``encodings.ascii`` module lazily, and ``--recover`` of an account's environment failed with
``LookupError: unknown encoding: ascii`` on every retry (its units down). The test runs each worker
entry point (every public function of :mod:`safeinstall.env.owner`, and a program started as the
account by :func:`safeinstall.system.children.run`) as uid 65534 from a fresh process of that hidden
safeinstall; ``test_faults.py`` has the ``--recover`` case end to end.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
from pathlib import Path

import pytest

from safeinstall.env import owner
from tests.beds import AS_ROOT, NOBODY, chown_tree, hidden_tool

#: run by the hidden interpreter, as root: each entry point in a worker as uid 65534; what each said
DRIVER = r"""
import json, sys
from pathlib import Path
import safeinstall.cli.app  # what a fresh run has loaded when it forks its first worker
from safeinstall.env import owner
from safeinstall.system import children, worker

prefix, cache, target = sys.argv[1:4]
ids = (int(sys.argv[4]), int(sys.argv[4]))
calls = {
    "keep_links": lambda: owner.keep_links(prefix, ".safeinstall-keep-r", ["lib/carried.py"], ["k"]),
    "relink_kept": lambda: owner.relink_kept(prefix, ".safeinstall-keep-r", ["lib/carried.py"], ["k"]),
    "remove_kept": lambda: owner.remove_kept(prefix, [], 30),
    "remove_installed": lambda: owner.remove_installed(
        prefix, ["lib/pkg/mod.py"], ["lib/pkg-1.0.dist-info"], ["lib"]
    ),
    "empty_directory": lambda: owner.empty_directory(prefix + "/scratch", 30),
    "uv_lock_holders": lambda: owner.uv_lock_holders(prefix),
    "replace_uv_lock": lambda: owner.replace_uv_lock(prefix, None),
    "remove_new_uv_lock": lambda: owner.remove_new_uv_lock(prefix),
    "read_texts": lambda: owner.read_texts([prefix + "/lib/carried.py", prefix + "/nothing"], 1000),
    "write_carried": lambda: owner.write_carried(Path(prefix), prefix + "/lib/carried.py", b"merged\n"),
    "copy_cached_wheels": lambda: owner.copy_cached_wheels(cache, target, [["pkg", "1.0"]]),
    "link_cached_wheels": lambda: owner.link_cached_wheels(cache, target + "/probe", [["pkg", "1.0"]]),
    "archive_print": lambda: owner.archive_print(Path(cache) / "archive-v0" / "abc123"),
}
said = {}
for name, work in calls.items():
    try:
        said[name] = worker.call(ids, work, timeout=60, what=name)
    except Exception as exc:
        said[name] = f"failed: {exc}"
done = children.run(["/bin/sh", "-c", "id -u"], env={"PATH": "/usr/bin:/bin"}, timeout=30, as_user=ids)
said["children.run"] = done.stdout.strip() if done.returncode == 0 else f"failed: {done.stderr}"
print(json.dumps(said))
"""


def _account_tree(top: Path) -> tuple[Path, Path, Path]:
    """A prefix, a uv cache with one unpacked wheel, and an empty target cache, all uid 65534's."""
    prefix, cache, target = top / "prefix", top / "cache", top / "target"
    (prefix / "lib" / "pkg").mkdir(parents=True)
    (prefix / "lib" / "pkg" / "mod.py").write_text("x = 1\n")
    (prefix / "lib" / "pkg-1.0.dist-info").mkdir()
    (prefix / "lib" / "pkg-1.0.dist-info" / "RECORD").write_text("pkg/mod.py,,\n")
    (prefix / "lib" / "carried.py").write_text("original\n")
    (prefix / "scratch" / "deep").mkdir(parents=True)
    (prefix / "scratch" / "deep" / "file").write_text("cached\n")
    (prefix / ".lock").write_text("")
    (cache / "archive-v0" / "abc123" / "pkg").mkdir(parents=True)
    (cache / "archive-v0" / "abc123" / "pkg" / "__init__.py").write_text("")
    (cache / "wheels-v5" / "pypi" / "pkg").mkdir(parents=True)
    (cache / "wheels-v5" / "pypi" / "pkg" / "1.0-py3-none-any.msgpack").write_bytes(b"\x80")
    os.symlink("../../../archive-v0/abc123", cache / "wheels-v5" / "pypi" / "pkg" / "1.0-py3-none-any")
    target.mkdir()
    for tree in (prefix, cache, target):
        chown_tree(tree, NOBODY)
    return prefix, cache, target


def test_every_worker_entry_point_runs_from_a_tool_the_account_cannot_read(
    tmp_path: Path, open_dir: Path
) -> None:
    if not AS_ROOT:
        pytest.skip("workers change their uid only as root")
    prefix, cache, target = _account_tree(open_dir)
    tool = hidden_tool(tmp_path / "tool")
    done = subprocess.run(
        [tool[0], "-I", "-c", DRIVER, str(prefix), str(cache), str(target), str(NOBODY)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    functions = inspect.getmembers(owner, inspect.isfunction)
    public = {name for name, f in functions if f.__module__ == owner.__name__ and not name.startswith("_")}
    assert public <= set(said), f"worker entry points the test does not run: {public - set(said)}"
    failed = {name: answer for name, answer in said.items() if isinstance(answer, str) and "failed" in answer}
    assert not failed, failed
    assert said["keep_links"] == {"kept": 1} and said["relink_kept"] == {"relinked": ["lib/carried.py"]}, said
    assert said["remove_kept"] == {"left": []} and not list(prefix.glob(".safeinstall-keep-*")), said
    assert said["remove_installed"]["removed"] == ["lib/pkg/mod.py"], said
    assert said["copy_cached_wheels"]["entries"] == ["pkg 1.0"], said
    assert said["link_cached_wheels"]["archives"] == ["archive-v0/abc123"], said
    printed = said["archive_print"]  # the fill's walk, the probe's links and the archive: one print
    assert (
        said["copy_cached_wheels"]["prints"]
        == said["link_cached_wheels"]["prints"]
        == {"archive-v0/abc123": printed}
    )
    assert said["children.run"] == str(NOBODY)
    assert said["read_texts"][0] == ["original\n", None] and said["read_texts"][1][0] is None, said
    assert (prefix / "lib" / "carried.py").read_text() == "merged\n"
    assert not list((prefix / "scratch").iterdir())
