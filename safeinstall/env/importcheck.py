"""The new version imported before anything stops, in a child run as the environment's account.

The child gets the unit's environment, no GPU and no descriptor of root's; its answers are data root
checks. What it imports and as whom: docs/reinstall.md ("The smoke check").
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import posixpath
import pwd
import re
import stat
import subprocess
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from safeinstall.env import owner
from safeinstall.env.environment import Environment
from safeinstall.system import children, worker
from safeinstall.system.safefs import Tree, others_who_write
from safeinstall.system.systemd import ExecContext

#: Seconds each child may take (the imports of one unit's context, or the operator's command).
SMOKE_TIMEOUT_S = 300.0
#: The lines of a failed child's standard error that are shown (each cut to LINE_LIMIT characters).
STDERR_LINES = 12
LINE_LIMIT = 400
#: What a child may print (per stream) and what one environment file may hold.
OUTPUT_LIMIT = 4 << 20
ENV_FILE_LIMIT = 1 << 20
#: The shim's name: Python imports ``sitecustomize`` from the first directory of sys.path that has one.
SHIM = "sitecustomize.py"
#: systemd's default PATH for services.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
#: What the child gets of the caller's environment (the rest is the unit's and the account's).
_FROM_CALLER = ("LANG", "LANGUAGE", "TZ")
#: What the dynamic loader (and the shell) would load code from, never taken from a unit: glibc's list
#: of what it ignores for a setuid program (its UNSECURE_ENVVARS), and ``BASH_ENV``/``ENV``. The child
#: is root (a root-owned environment) or the environment's account, and the unit's user may write what
#: they name (the attacker review). ``LD_LIBRARY_PATH`` and ``LD_PRELOAD`` are filtered by entry instead.
_LOADER = frozenset(
    {
        "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LD_AUDIT", "LD_DEBUG", "LD_DEBUG_OUTPUT",
        "LD_DYNAMIC_WEAK", "LD_HWCAP_MASK", "LD_ORIGIN_PATH", "LD_PROFILE", "LD_SHOW_AUXV",
        "LD_USE_LOAD_BIAS", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH", "NLSPATH",
        "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR", "BASH_ENV", "ENV",
    }
)  # fmt: skip
#: Lists of paths code is loaded from: each entry kept only where no one else controls it.
_PATH_LISTS = {"PYTHONPATH": os.pathsep, "LD_LIBRARY_PATH": ":", "LD_PRELOAD": " :", "PATH": ":"}
#: Python's own variables a unit may give the child; every other ``PYTHON*`` names code or where code is
#: looked for (``PYTHONHOME``, ``PYTHONUSERBASE``, ``PYTHONSTARTUP``, ``PYTHONWARNINGS``...): never.
_PYTHON_KEPT = frozenset(
    {"PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONNOUSERSITE"}
)

#: The NVIDIA driver's libraries: an extension module that needs one cannot be loaded on a host without
#: the driver, whichever version it is (:func:`read_answers`).
DRIVER_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")

#: Set for every child, whatever the unit says: no GPU, no bytecode written, the staged tree ahead.
NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}

#: Where the shim finds the trees it puts ahead ("": none, the running version alone).
SITES_VARIABLE = "SAFEINSTALL_SMOKE_SITES"

#: The shim (a ``sitecustomize`` on ``PYTHONPATH``): the trees named in ``SAFEINSTALL_SMOKE_SITES`` go
#: ahead of everything on ``sys.path`` (their ``.pth`` files run), then the environment's own
#: ``sitecustomize``, if it has one, is imported as Python would have.
SHIM_TEXT = '''"""safeinstall's smoke check: the staged new version ahead of the environment's sites."""
import os as _os
import site as _site
import sys as _sys


def _ahead():
    here = _os.path.dirname(_os.path.abspath(__file__))
    sites = [s for s in _os.environ.get("SAFEINSTALL_SMOKE_SITES", "").split(_os.pathsep) if s]
    before = [p for p in _sys.path if p != here]
    for tree in sites:
        _site.addsitedir(tree)
    added = [p for p in _sys.path if p not in before and p != here]
    _sys.path[:] = added + [p for p in before if p not in added]
    me = _sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  the environment's own
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        if me is not None:
            _sys.modules.setdefault("sitecustomize", me)


_ahead()
'''

#: The import child: argv[1] is a JSON document {"sites", "package", "changed"}. It answers on
#: descriptor 3 (a copy of its stdout; its own stdout goes to stderr, so that what an import prints
#: cannot be taken for an answer): {"module": M} before each import, then {"ok": M}, {"skipped": M},
#: {"unavailable": M, "error": LIBRARY} (an ImportError, or one raised while handling it, or the
#: loader's own error for the extension module's file when its package failed first, that says the
#: loader found no NVIDIA driver library, and the child cannot load that library either: the host
#: cannot load the module, whatever the version; not imported, said; an error on the way to it that
#: names an undefined symbol or another library is the module's own: failed) or {"failed": M, "error": TEXT};
#: {"done": N} at the end.
CHILD_SCRIPT = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # first: nothing of the directory it runs in
import importlib, importlib.machinery, json, os, re, struct, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
def say(**kw):
    answers.write(json.dumps(kw) + "\n")
    answers.flush()
spec = json.loads(sys.argv[1])
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
changed = set(spec["changed"])
package = spec["package"]
suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=len, reverse=True)
def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()
def exports_init(path, stem):
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return True
            wide, end = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide:
                (shoff,) = struct.unpack_from(end + "Q", head, 0x28)
                size, count = struct.unpack_from(end + "HH", head, 0x3A)
            else:
                (shoff,) = struct.unpack_from(end + "I", head, 0x20)
                size, count = struct.unpack_from(end + "HH", head, 0x2E)
            f.seek(shoff)
            table = f.read(size * count)
            def section(i):
                base = i * size
                kind = struct.unpack_from(end + "I", table, base + 4)[0]
                if wide:
                    off, length = struct.unpack_from(end + "QQ", table, base + 0x18)
                    link = struct.unpack_from(end + "I", table, base + 0x28)[0]
                else:
                    off, length = struct.unpack_from(end + "II", table, base + 0x10)
                    link = struct.unpack_from(end + "I", table, base + 0x18)[0]
                return kind, off, length, link
            for i in range(count):
                kind, _, _, link = section(i)
                if kind == 11:
                    _, off, length, _ = section(link)
                    f.seek(off)
                    return (b"\0PyInit_" + stem.encode() + b"\0") in f.read(length)
            return False
    except (OSError, struct.error, IndexError):
        return True
tops, extensions, files, owned, scripts = [], [], {}, {}, {}
wanted_scripts = set(spec.get("scripts", ()))
for tree in spec["sites"]:
    try:
        entries = sorted(os.listdir(tree))
    except OSError:
        continue
    for entry in entries:
        if not entry.endswith(".dist-info"):
            continue
        name = canonical(entry[: -len(".dist-info")].rpartition("-")[0] or entry)
        if name not in changed:
            continue
        try:
            with open(os.path.join(tree, entry, "RECORD"), encoding="utf-8") as f:
                paths = [line.rsplit(",", 2)[0].strip('"') for line in f if line.strip()]
        except OSError:
            continue
        try:
            with open(os.path.join(tree, entry, "entry_points.txt"), encoding="utf-8") as f:
                section = ""
                for line in f:
                    line = line.strip()
                    if line.startswith("["):
                        section = line.strip("[]").strip()
                    elif section == "console_scripts" and "=" in line:
                        script, _, target = line.partition("=")
                        target = target.partition(":")[0].strip()
                        dotted = target.split(".")
                        if script.strip() in wanted_scripts and all(p.isidentifier() for p in dotted):
                            scripts.setdefault(target, name)
        except OSError:
            pass
        for path in paths:
            parts = path.split("/")
            if path.startswith(("/", "..")) or parts[0].endswith((".dist-info", ".data")):
                continue
            suffix = next((s for s in suffixes if path.endswith(s)), None)
            stem = path[: -len(suffix)] if suffix else path[:-3] if path.endswith(".py") else None
            if stem is None:
                continue
            dotted = stem.split("/")
            if dotted[-1] == "__init__":
                dotted = dotted[:-1]
            if not dotted or not all(p.isidentifier() for p in dotted):
                continue
            owned.setdefault(".".join(dotted), name)
            if name == package and dotted[0] not in tops and len(parts) >= 1:
                tops.append(dotted[0])
                owned.setdefault(dotted[0], name)
            if suffix is not None:
                full = os.path.join(tree, path)
                if suffix != ".so" or exports_init(full, dotted[-1]):
                    extensions.append(".".join(dotted))
                    files.setdefault(".".join(dotted), full)
run = [m for m in spec.get("run", ()) if m in owned] + sorted(scripts)
owned.update((m, d) for m, d in scripts.items() if m not in owned)
modules = list(dict.fromkeys(
    sorted(tops) + run + sorted(dict.fromkeys(extensions)) + [m for m in spec.get("also", ()) if m]
))
must = set(tops) | set(run)  # what the service itself imports first: never excused by its absence
skip = tuple(spec.get("skip", ()))
def skipped(module):
    return any(module == s or module.startswith(s + ".") for s in skip)
def chain(exc):
    said, seen = [], set()
    while exc is not None and id(exc) not in seen and len(said) < 8:
        seen.add(id(exc))
        said.append("%s: %s" % (type(exc).__name__, exc))
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return " <- ".join(said)
absent = {}
def host_lacks(library):
    if library not in absent:
        import ctypes
        try:
            ctypes.CDLL(library)
            absent[library] = False
        except OSError:
            absent[library] = True
    return absent[library]
DRIVER = ("libcuda.so.1", "libnvidia-ml.so.1")
def driver_missing(exc):
    for _ in range(20):
        if exc is None:
            return None
        text = str(exc)
        for library in DRIVER:
            if library + ": cannot open shared object file" in text and host_lacks(library):
                return library
        if "undefined symbol" in text or ": cannot open shared object file" in text:
            return None  # broken otherwise, whatever error it was raised while handling
        exc = exc.__cause__ or exc.__context__
    return None
def unloadable(module, exc):
    library = driver_missing(exc) if isinstance(exc, ImportError) else None
    if library is None and isinstance(exc, ImportError) and module in files:  # its package failed first?
        try:
            import ctypes
            ctypes.CDLL(files[module], mode=os.RTLD_NOW)  # the file itself, as the loader sees it
        except OSError as direct:
            library = driver_missing(direct)
    return library
failed = 0
for module in modules:
    if skipped(module):
        say(skipped=module)
        continue
    say(module=module, dist=owned.get(module, ""), must=module in must)
    try:
        importlib.import_module(module)
    except BaseException as exc:
        library = unloadable(module, exc)
        if library is not None:
            say(unavailable=module, error=library)
            continue
        failed += 1
        frames = [
            f for f in traceback.extract_tb(exc.__traceback__)
            if not f.filename.startswith("<") and not f.filename.endswith(("importlib/__init__.py",))
        ]
        print("".join(traceback.format_list(frames)), end="", file=sys.stderr)
        print("".join(traceback.format_exception_only(type(exc), exc)), end="", file=sys.stderr)
        say(failed=module, error=chain(exc)[:2000])
    else:
        say(ok=module)
say(done=len(modules))
sys.stderr.flush()
os._exit(1 if failed else 0)
"""


@dataclass(frozen=True, slots=True)
class RunAs:
    """The account a child runs as (not root): a unit's ``User=`` as systemd makes it, or the account
    that owns the environment (no supplementary groups: as uv runs as it)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary: the user's own (initgroups) and SupplementaryGroups=
    home: str
    unit_user: bool = False  # the User= of a unit (in a root-owned environment), not the owner

    @property
    def ids(self) -> tuple[int, int]:
        return self.uid, self.gid

    def said(self) -> str:
        """Pure: the account in a few words, for the plan and the log."""
        why = ", the unit's User=" if self.unit_user else ""
        return f"{self.name} (uid {self.uid}{why})"


@dataclass(frozen=True, slots=True)
class Context:
    """How a unit runs its processes: the variables the child gets from it, where it runs, and as whom
    (None: root)."""

    unit: str | None  # None: no unit (the environment's account, systemd's defaults)
    variables: tuple[tuple[str, str], ...]
    cwd: str
    notes: tuple[str, ...] = ()  # what of the unit's could not be taken (an unreadable file...)
    run_as: RunAs | None = None
    run: tuple[str, ...] = ()  # the modules its units' commands run (``python -m MOD``)
    scripts: tuple[str, ...] = ()  # the programs its units' commands run, by name (console scripts)
    flags: tuple[str, ...] = ()  # of ``-s``, ``-E``, ``-I``: what its units' interpreter is given
    also: tuple[str, ...] = ()  # the other units that run the same way (one child for all)


@dataclass(frozen=True, slots=True)
class Entry:
    """What a unit's command runs first, as far as it can be told from its argv: a module
    (``python -m MOD``), a program by name (a console script: its entry point is the new version's),
    and the interpreter's options that change what it loads (``-s``, ``-E``, ``-I``)."""

    run: tuple[str, ...] = ()
    scripts: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()


#: The interpreter's options that take an argument (``-X dev``, ``-W error``, ``-m MOD``, ``-c CMD``).
_WITH_ARGUMENT = "mcWXQ"
#: Options of the interpreter that change what it loads, kept for the check (see :func:`child_variables`).
KEPT_FLAGS = ("-s", "-E", "-I")


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def service_entry(argv: Sequence[str]) -> Entry:
    """Pure: what the command ``argv`` (a unit's ``ExecStart=``) runs first (:class:`Entry`); a ``.py``
    file's own imports are not guessed."""
    words = list(argv)
    if words and os.path.basename(words[0]) == "env":  # /usr/bin/env [-i] [A=B] python ...
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):
            words = words[1:]
    if not words:
        return Entry()
    name = os.path.basename(words[0])
    if not re.fullmatch(r"python[0-9.]*", name):
        return Entry(scripts=(name,))
    flags: list[str] = []
    index = 1
    while index < len(words):
        word = words[index]
        if word == "--" or word == "-" or not word.startswith("-"):
            break
        index += 1
        if word.startswith("--"):
            continue
        for at, letter in enumerate(word[1:], start=1):
            if letter in _WITH_ARGUMENT:
                argument = word[at + 1 :]
                if not argument and index < len(words):
                    argument = words[index]
                    index += 1
                if letter == "m":
                    return Entry(run=(argument,) if _dotted(argument) else (), flags=tuple(flags))
                if letter == "c":
                    return Entry(flags=tuple(flags))
                break
            if f"-{letter}" in KEPT_FLAGS and f"-{letter}" not in flags:
                flags.append(f"-{letter}")
    if index < len(words) and words[index] == "--":
        index += 1
    script = os.path.basename(words[index]) if index < len(words) else ""
    scripts = (script,) if script and not script.endswith(".py") else ()
    return Entry(scripts=scripts, flags=tuple(flags))


#: in a child's ``problem`` when it ran past ``--smoke-timeout`` (the hint then says to raise it)
TIMED_OUT = "(--smoke-timeout)"


@dataclass(frozen=True, slots=True)
class ChildOutcome:
    """One child: what it was, what it answered, and its last lines of standard error."""

    what: str  # "imports" or the operator's command
    context: Context
    ok: bool
    imported: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]  # (module, error)
    problem: str | None  # the child died, ran too long, answered nonsense, or its command failed
    stderr_tail: tuple[str, ...]
    #: (module, library): not importable on this host, which has no NVIDIA driver (see CHILD_SCRIPT)
    unavailable: tuple[tuple[str, str], ...] = ()
    #: (module, distribution) of each module it tried: whose module it is, as the child found it
    owners: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()  # not imported: --smoke-skip names them
    #: (module, error): failed, but the running version cannot import them either (not held against it)
    excused: tuple[tuple[str, str], ...] = ()
    must: frozenset[str] = frozenset()  # what the service imports first (see :func:`read_details`)


@dataclass(frozen=True, slots=True)
class Wanted:
    """What an import child imports besides the top-level and extension modules: the modules a unit's
    command runs (``python -m MOD``: ``run``; a console script's entry point: ``scripts``, by name),
    modules to leave out (``--smoke-skip``: ``skip``, each with its submodules) and modules asked
    about by name (``also``: the running version asked about the new version's failures)."""

    run: tuple[str, ...] = ()
    scripts: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    also: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------ pure parts


def parse_environment_file(text: str) -> list[tuple[str, str]]:
    """Pure: the assignments of an ``EnvironmentFile=`` as systemd reads one: ``KEY=VALUE`` lines,
    ``#`` and ``;`` comments, a value in single or double quotes, a backslash at the end of a line
    continuing it."""
    found: list[tuple[str, str]] = []
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        pending = ""
        logical.append(line)
    if pending:
        logical.append(pending)
    for line in logical:
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        key, sep, value = stripped.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
            if stripped.partition("=")[2].strip()[0] == '"':
                value = re.sub(r"\\(.)", r"\1", value)
        found.append((key, value))
    return found


def unit_variables(
    variables: Sequence[tuple[str, str]], controlled: Callable[[str], bool]
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Pure: the unit's variables the child takes, and what was left out, said. Nothing naming code to load
    is taken unless only root and the child's account control it (``controlled``).
    """
    kept: list[tuple[str, str]] = []
    dropped: list[str] = []
    for name, value in variables:
        if name in _PATH_LISTS:
            separators = _PATH_LISTS[name]
            entries = [e for e in re.split(f"[{re.escape(separators)}]", value) if e]
            ours = [e for e in entries if e.startswith("/") and controlled(e)]
            dropped.extend(f"{name} entry {e}" for e in entries if e not in ours)
            if ours:
                kept.append((name, separators[-1].join(ours)))
        elif (
            name in _LOADER
            or name.startswith("LD_")
            or (name.startswith("PYTHON") and name not in _PYTHON_KEPT)
        ):
            dropped.append(name)
        else:
            kept.append((name, value))
    return tuple(kept), tuple(dropped)


#: Of a unit's variables, what a root check takes whatever their value (the attacker review, 4): the
#: judged lists (:data:`_PATH_LISTS`) and Python's own kept ones. ``HOME`` is taken where it is relative
#: (its user site judged) or root's alone; any other only where every path it names is root's alone
#: (``OPENSSL_CONF`` naming another user's configuration loads that user's provider).
_ROOT_KEPT = frozenset({*_PATH_LISTS, *_PYTHON_KEPT})


#: a URL in a variable's value, up to a separator: scheme, user, host (2), port, path (3)
_URL = re.compile(
    r"([A-Za-z][A-Za-z0-9+.-]*)://(?:[^\s/:;,@]*(?::[^\s/;,@]*)?@)?(\[[0-9A-Fa-f:.]*\]|[^\s/:;,]*)(?::[0-9]+)?(/[^\s:;,]*)?"
)


def _local(url: re.Match[str]) -> str:
    """What a URL may name on this host: its host (``http+unix://%2Frun%2Fx.sock``) and, for a ``file:``
    one or one without a host (``unix:///run/x.sock``, ``sqlite:////var/db``), its path."""
    host, path = url.group(2), url.group(3) or ""
    return f" {host} {path if url.group(1).lower() == 'file' or not host else ''} "


#: How many rounds of ``%XX`` decoding a token may take (``%2525...``: one more each): past it, dropped
_DECODE_ROUNDS = 4


def _decoded(token: str) -> str | None:
    """Pure: ``token`` with its ``%XX`` escapes decoded until none is left (a library reading a URL decodes
    them: ``file:///home/bo%62/x`` is /home/bob/x); None past :data:`_DECODE_ROUNDS` rounds."""
    for _ in range(_DECODE_ROUNDS):
        once = urllib.parse.unquote(token)
        if once == token:
            return token
        token = once
    return None


def _names_only_roots(value: str, judged: Callable[[str], bool], cwd: str) -> bool:
    """Pure (given ``judged``): every path in ``value`` (split at blanks, ``:``, ``;``, ``,`` and ``=``;
    a URL's host and a local URL's path, ``%XX`` decoded; a relative one from ``cwd``) is root's alone as
    a tree; none goes up (``..``) or starts from a home (``~``)."""
    for token in re.split(r"[\s:;,=]+", _URL.sub(_local, value)):
        decoded = _decoded(token)
        if decoded is None or decoded.startswith("~") or "\0" in decoded:  # ``%00``: a library cuts there
            return False
        token = re.sub("/+", "/", decoded)  # ``//home/bob`` is /home/bob
        if "/" not in token:
            continue
        if ".." in token.split("/") or not judged(os.path.join(cwd, token)):  # a model id ``org/name``
            return False
    return True


def root_variables(
    variables: Sequence[tuple[str, str]],
    judged: Callable[[str], bool],
    owned: Callable[[str], bool],
    cwd: str,
) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Pure (given ``judged``: a path root's alone, its whole tree; ``owned``: the path and the directories
    above it root's alone): of the unit's variables (as :func:`unit_variables` kept them), those a root
    child running in ``cwd`` takes, and the names of the rest (docs/reinstall.md)."""
    kept: list[tuple[str, str]] = []
    dropped: list[str] = []
    for name, value in variables:
        if name in ("LANG", "LANGUAGE") or name.startswith("LC_"):
            ours = "/" not in value
        elif name == "TZ" and not value.lstrip(":").startswith("/"):
            ours = ".." not in value  # a zone name, read below the system's zone data
        elif name == "HOME":  # a relative one: its user site is judged from where the child runs
            ours = not value.startswith("/") or owned(value)  # not its whole tree: root's home holds caches
        else:
            ours = name in _ROOT_KEPT or _names_only_roots(value, judged, cwd)
        if ours:
            kept.append((name, value))
        else:
            dropped.append(name)
    return tuple(kept), tuple(dropped)


def _entries(name: str, value: str) -> list[str]:
    return [e for e in re.split(f"[{re.escape(_PATH_LISTS[name])}]", value) if e]


def others_loaded(
    variables: Sequence[tuple[str, str]], flags: Sequence[str], finding: Callable[[str], str | None]
) -> list[str]:
    """Pure (given ``finding``: who else controls what may be loaded from a path, said; None: no one):
    what the check would load from a path another controls, each entry of the unit's ``PYTHONPATH``
    (unless ``-E``/``-I``: the service ignores it), ``LD_LIBRARY_PATH``, ``LD_PRELOAD`` and ``PATH``
    (systemd's default when the unit sets none), said with the entry."""
    given = dict(variables)
    ignored = "-E" in flags or "-I" in flags
    said: list[str] = []
    for name in _PATH_LISTS:
        if ignored and name.startswith("PYTHON"):
            continue
        for entry in _entries(name, given.get(name, DEFAULT_PATH if name == "PATH" else "")):
            found = finding(entry) if entry.startswith("/") else None
            if found is not None:
                said.append(f"{name} entry {entry}: {found}")
    return said


def user_site(
    variables: Sequence[tuple[str, str]], home: str, flags: Sequence[str], version: tuple[int, ...], cwd: str
) -> str | None:
    """Pure: the user's site directory the check's interpreter would add (``HOME`` as the unit gives it,
    else the account's), as ``site`` makes it (``~`` expanded, a relative ``HOME`` taken from ``cwd``,
    where the child runs, ``..`` resolved by name); None when the unit turns it off (``-s``, ``-I``,
    ``PYTHONNOUSERSITE`` unless ``-E``) as the service has it."""
    given = dict(variables)
    ignored = "-E" in flags or "-I" in flags
    if "-s" in flags or "-I" in flags or (not ignored and given.get("PYTHONNOUSERSITE")):
        return None
    base = given.get("HOME", home).rstrip("/")  # expanduser: "" and "/" are "/"
    site = f"{base}/.local/lib/python{version[0]}.{version[1]}/site-packages"
    return posixpath.normpath(posixpath.join(cwd, site))


def child_variables(
    caller: Mapping[str, str],
    account: tuple[str, str],  # (name, home)
    unit: Sequence[tuple[str, str]],
    env: Environment,
    shim_dir: Path,
    sites: Sequence[Path],
    flags: Sequence[str] = (),
) -> dict[str, str]:
    """Pure: the child's whole environment: locale and time zone, the account's ``HOME``/``USER``, the unit's
    variables, then no GPU, no bytecode, the environment's ``bin`` and the shim first. ``flags``: the
    unit's interpreter options (:data:`KEPT_FLAGS`) kept as variables, as in the service.
    """
    variables = {k: caller[k] for k in _FROM_CALLER if k in caller}
    variables |= {"HOME": account[1], "USER": account[0], "LOGNAME": account[0]}
    variables |= dict(seen_variables(unit, flags))
    python_path = [str(shim_dir), *[p for p in variables.get("PYTHONPATH", "").split(os.pathsep) if p]]
    variables |= NO_GPU
    variables |= {
        "PATH": os.pathsep.join([str(env.scripts), variables["PATH"]]),
        "PYTHONPATH": os.pathsep.join(python_path),
        "PYTHONDONTWRITEBYTECODE": "1",
        SITES_VARIABLE: os.pathsep.join(str(s) for s in sites),
    }
    return variables


#: What every child is given whatever the unit says (:func:`child_variables`): a unit's own value of
#: one of these never reaches the check.
REPLACED = frozenset({*NO_GPU, "PYTHONDONTWRITEBYTECODE", SITES_VARIABLE})


def seen_variables(unit: Sequence[tuple[str, str]], flags: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """Pure: the unit's variables as the check's child sees them (:func:`child_variables`), by name:
    ``PATH`` systemd's default where the unit sets none, the ``PYTHON*`` ones dropped under ``-E``/``-I``,
    ``PYTHONNOUSERSITE`` set by ``-s``/``-I``, those in :data:`REPLACED` left out. Units alike in
    these, account, directory and flags share one child (docs/reinstall.md)."""
    ignored = "-E" in flags or "-I" in flags
    seen = {"PATH": DEFAULT_PATH}
    seen |= {k: v for k, v in unit if not (ignored and k.startswith("PYTHON")) and k not in REPLACED}
    if "-s" in flags or "-I" in flags:
        seen["PYTHONNOUSERSITE"] = "1"
    return tuple(sorted(seen.items()))


def answers_key(context: Context, uid: int) -> str:
    """Pure: the check context the running version's answers hold for (a digest): whom the child runs as
    (``uid`` for a child of no :class:`RunAs`), the unit's variables as it sees them, its directory and
    the interpreter's flags. A failure is excused only by answers of the same context: another unit's
    user may answer anything in their own (the attacker review)."""
    run_as = context.run_as
    who = [uid] if run_as is None else [run_as.uid, run_as.gid, list(run_as.groups), run_as.home]
    seen = seen_variables(context.variables, context.flags)
    text = json.dumps([who, seen, context.cwd, list(context.flags)])
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def working_directory(setting: str, home: str, user_manager: bool) -> str:
    """Pure: the directory a unit's process starts in (systemd's rules: unset is ``/`` for the system
    manager and the user's home for a user's; ``~`` is the home)."""
    if setting == "~" or (not setting and user_manager):
        return home
    return setting if setting.startswith("/") else "/"


#: What the import child answered: the modules imported, the ones that failed (with their error), the
#: module it was importing when it stopped answering (None: none), whether it said it was done, and the
#: modules it could not load for want of the NVIDIA driver (with the library).
Answers = tuple[tuple[str, ...], tuple[tuple[str, str], ...], str | None, bool, tuple[tuple[str, str], ...]]


def read_answers(text: str) -> Answers:
    """Pure: the import child's answer lines, as data (the account's word; see :data:`Answers`). Lines
    that are not such documents are ignored; an ``unavailable`` answer counts only with one of the
    driver's libraries."""
    imported: list[str] = []
    failed: list[tuple[str, str]] = []
    unavailable: list[tuple[str, str]] = []
    started: str | None = None
    done = False
    for line in text.splitlines():
        try:
            answer = json.loads(line)
        except (ValueError, RecursionError):  # the account's word: a nested line is no answer
            continue
        if not isinstance(answer, dict):
            continue
        kinds = ("module", "ok", "failed", "unavailable")
        module = next((answer[k] for k in kinds if isinstance(answer.get(k), str)), None)
        if "module" in answer and module is not None:
            started = module[:300]
        elif "ok" in answer and module is not None:
            imported.append(module[:300])
            started = None
        elif "failed" in answer and module is not None:
            failed.append((module[:300], str(answer.get("error", ""))[:2000]))
            started = None
        elif "unavailable" in answer and module is not None:
            if answer.get("error") in DRIVER_LIBRARIES:  # any other library: no such answer
                unavailable.append((module[:300], str(answer["error"])))
            started = None
        elif "done" in answer:
            done = True
    return tuple(imported), tuple(failed), started, done, tuple(unavailable)


def read_details(text: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], frozenset[str]]:
    """Pure: of the import child's answer lines, whose each module it tried is (module, distribution),
    the modules it left out (``--smoke-skip``) and those the service itself imports first (the
    package's top-level modules, what a unit's command runs)."""
    owners: dict[str, str] = {}
    skipped: list[str] = []
    must: set[str] = set()
    for line in text.splitlines():
        try:
            answer = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(answer, dict):
            continue
        module, dist = answer.get("module"), answer.get("dist")
        if isinstance(module, str) and isinstance(dist, str) and dist:
            owners.setdefault(module[:300], dist[:300])
        if isinstance(module, str) and answer.get("must") is True:
            must.add(module[:300])
        if isinstance(answer.get("skipped"), str):
            skipped.append(answer["skipped"][:300])
    return tuple(owners.items()), tuple(skipped), frozenset(must)


#: What the running version says of a module it does not have at all.
ABSENT = "ModuleNotFoundError: "


def unknown(outcome: ChildOutcome, old: Mapping[str, Mapping[str, str]]) -> dict[str, tuple[str, ...]]:
    """Pure: by distribution of the running version (``old``: its answers, by distribution), the new
    version's failed modules it has not been asked about."""
    owners = dict(outcome.owners)
    asked: dict[str, list[str]] = {}
    for module, _ in outcome.failed:
        dist = owners.get(module)
        if dist is not None and dist in old and module not in old[dist]:
            asked.setdefault(dist, []).append(module)
    return {dist: tuple(modules) for dist, modules in asked.items()}


def excuse(outcome: ChildOutcome, old: Mapping[str, Mapping[str, str]]) -> ChildOutcome:
    """Pure: ``outcome`` with each failure the running version shares (``old``) kept as ``excused``, not
    held against the new one. A ``must`` module the running version lacks, and a child that died or ran
    too long, are never excused.
    """
    if outcome.ok or outcome.problem is not None or not outcome.failed:
        return outcome
    owners = dict(outcome.owners)
    kept: list[tuple[str, str]] = []
    excused: list[tuple[str, str]] = []
    for module, error in outcome.failed:
        before = old.get(owners.get(module, ""), {}).get(module, "")
        shared = bool(before) and not (module in outcome.must and before.startswith(ABSENT))
        (excused if shared else kept).append((module, error))
    return replace(outcome, ok=not kept, failed=tuple(kept), excused=(*outcome.excused, *excused))


def unavailable_note(outcomes: Sequence[ChildOutcome]) -> str | None:
    """Pure: what the check could not import on this host (no NVIDIA driver), for the run's notes."""
    modules = sorted({module for o in outcomes for module, _ in o.unavailable})
    if not modules:
        return None
    libraries = sorted({library for o in outcomes for _, library in o.unavailable})
    shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
    return (
        f"smoke check: {len(modules)} module(s) of the new version need {' and '.join(libraries)} of the "
        f"NVIDIA driver, which this host does not have: not imported ({shown})"
    )


def excused_note(outcomes: Sequence[ChildOutcome]) -> str | None:
    """Pure: the new version's failures the running version shares, for the run's notes."""
    excused = {module: error for o in outcomes for module, error in o.excused}
    if not excused:
        return None
    said = "; ".join(f"{module} ({error[:200]})" for module, error in sorted(excused.items())[:8])
    return (
        f"smoke check: {len(excused)} module(s) the running version cannot import either were not held "
        f"against the new version: {said}"
    )


def skipped_note(outcomes: Sequence[ChildOutcome]) -> str | None:
    """Pure: what ``--smoke-skip`` left out, for the run's notes."""
    skipped = sorted({module for o in outcomes for module in o.skipped})
    return f"smoke check: not imported (--smoke-skip): {', '.join(skipped)}" if skipped else None


def tail(text: str, lines: int = STDERR_LINES) -> tuple[str, ...]:
    """Pure: the last ``lines`` non-empty lines of ``text``, each at most :data:`LINE_LIMIT` characters."""
    kept = [line.rstrip()[:LINE_LIMIT] for line in text.splitlines() if line.strip()]
    return tuple(kept[-lines:])


def describe(
    package: str,
    command: str | None,
    timeout: float,
    runners: Sequence[tuple[str, Sequence[str]]],
    skip: Sequence[str] = (),
    shared: Sequence[str] = (),
) -> str:
    """Pure: what the run runs before the stop (the plan says it): ``runners``, whom the check runs as
    and for which units (none: a clean environment, as systemd gives a unit); ``skip``, what
    ``--smoke-skip`` leaves out; ``shared``, what the running version is known not to import (from an
    earlier check)."""
    where = "; ".join(
        f"as {who}, environment of {', '.join(units)}" if units else f"as {who}, no unit's environment"
        for who, units in runners
    )
    more = f", then `{command}`" if command else ""
    left = f"; left out (--smoke-skip): {', '.join(skip)}" if skip else ""
    known = f" (known: {', '.join(shared[:8])}{' ...' if len(shared) > 8 else ''})" if shared else ""
    return (
        f"{where}; no GPU: import {package}'s top-level modules, the modules its units' commands run and "
        f"the changed distributions' extension modules from the new version{more} (at most {timeout:g} s "
        f"each); a module the running version cannot import either is said, not refused{known}{left}"
    )


def runner_said(found: RunAs | str | None) -> str:
    """Pure: whom a unit's check runs as in a root-owned environment, in the plan's words (``found``:
    :func:`unit_account`'s answer)."""
    if isinstance(found, RunAs):
        return found.said()
    if isinstance(found, str):
        return f"no one: not checked ({found}; never as root instead)"
    return "root (the unit has no User=: it runs as root too)"


def logged(outcome: ChildOutcome) -> str:
    """Pure: one child's outcome for the run's log: what it imported and what failed, never the unit's
    variables (an ``EnvironmentFile=`` may hold a token)."""
    where = ", ".join((outcome.context.unit, *outcome.context.also)) if outcome.context.unit else "no unit"
    said = f"{outcome.what} ({where}, in {outcome.context.cwd}): {'ok' if outcome.ok else 'FAILED'}"
    said += f"; imported {', '.join(outcome.imported) or 'nothing'}"
    said += "".join(f"; {module}: {error}" for module, error in outcome.failed)
    said += f"; {outcome.problem}" if outcome.problem else ""
    return said + "".join(f"\n  {line}" for line in outcome.stderr_tail)


def failure_message(outcomes: Sequence[ChildOutcome]) -> str:
    """Pure: why the run is refused, with each failed child's last lines of standard error."""
    parts: list[str] = []
    for outcome in outcomes:
        if outcome.ok:
            continue
        units = ", ".join((outcome.context.unit, *outcome.context.also)) if outcome.context.unit else ""
        where = f" (environment of {units})" if units else ""
        said = [f"{module}: {error}" for module, error in outcome.failed[:5]]
        if outcome.problem:
            said.append(outcome.problem)
        imports = outcome.what == "imports"
        head = "the import of the new version failed" if imports else f"`{outcome.what}` failed"
        text = f"{head}{where}: " + "; ".join(said)
        new = [line for line in outcome.stderr_tail if line.strip() and line.strip() not in text]
        if new:  # what the error above does not already say (its own last line, most often)
            text += "\nits last lines of standard error:\n" + "\n".join("  " + line for line in new)
        parts.append(text)
    return "\n".join(parts)


# ------------------------------------------------------------------------------------- I/O parts


def _group_id(given: str) -> int | None:
    """A group as systemd takes it (a name, or a number the group database knows); None: unknown."""
    try:
        return grp.getgrgid(int(given)).gr_gid if given.isdigit() else grp.getgrnam(given).gr_gid
    except (KeyError, ValueError, OverflowError):
        return None


def unit_account(context: ExecContext) -> RunAs | str | None:
    """Whom ``context``'s unit runs as, resolved as systemd resolves ``User=``, ``Group=``,
    ``DynamicUser=`` and its supplementary groups. None: root; a str: why it cannot be told.
    """
    name = context.user or (context.unit.rpartition(".")[0] if context.dynamic_user else "")
    if not name:
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError, OverflowError):
        return f"its User={name} is no user this machine knows"
    if entry.pw_uid == 0:
        return None
    gid = entry.pw_gid
    if context.group:
        found = _group_id(context.group)
        if found is None:
            return f"its Group={context.group} is no group this machine knows"
        gid = found
    groups = list(os.getgrouplist(entry.pw_name, gid)) if gid != 0 else []
    for given in context.supplementary_groups:
        found = _group_id(given)
        if found is None:
            return f"its SupplementaryGroups= names {given}, no group this machine knows"
        groups.append(found)
    return RunAs(entry.pw_name, entry.pw_uid, gid, tuple(dict.fromkeys(groups)), entry.pw_dir, True)


def owner_account(env: Environment) -> RunAs | None:
    """The account that owns ``env`` as a :class:`RunAs` (None: root's environment)."""
    if env.account is None:
        return None
    name, home = account_of(env)
    return RunAs(name, env.account.uid, env.account.gid, (), home)


def account_of(env: Environment) -> tuple[str, str]:
    """The (name, home) of the account the child runs as: the environment's owner, else the caller
    (root, or the user of a ``--user`` run)."""
    uid = os.geteuid() if env.account is None else env.account.uid
    try:
        entry = pwd.getpwuid(uid)
        name, home = entry.pw_name, entry.pw_dir
    except KeyError:
        name, home = str(uid), "/"
    return name, env.account.home if env.account is not None else home


def read_environment_files(
    files: Sequence[tuple[str, bool]], ids: tuple[int, int] | None
) -> tuple[list[tuple[str, str]], list[str]]:
    """The assignments of a unit's ``EnvironmentFile=`` files, read as the child's account ``ids`` (a
    file it may not read is not given to its process: said, never read by root for it); and the notes."""
    if not files:
        return [], []
    paths = [path for path, _ in files]
    try:
        answer = worker.call(
            ids,
            lambda: owner.read_texts(paths, ENV_FILE_LIMIT),
            timeout=30,
            what="reads the unit's environment files",
        )
    except worker.WorkerError as exc:
        return [], [f"the unit's environment files were not read: {exc.message}"]
    found: list[tuple[str, str]] = []
    notes: list[str] = []
    if not isinstance(answer, list) or len(answer) != len(files):
        return [], ["the unit's environment files were not read: the worker answered nonsense"]
    for (path, ignore), item in zip(files, answer, strict=True):
        text = item[0] if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) else None
        if text is None:
            if not ignore:
                why = item[1] if isinstance(item, list) and len(item) == 2 else "?"
                said = str(why)[:200]
                notes.append(f"EnvironmentFile {path} was not read as the check's account: {said}")
            continue
        found.extend(parse_environment_file(text))
    return found, notes


def write_shim(directory: Path) -> Path:
    """Root's directory (0755) in root's state directory, with the shim (0644): the account reads it."""
    os.mkdir(directory, 0o755)
    os.chmod(directory, 0o755)
    fd = os.open(directory / SHIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, SHIM_TEXT.encode())
    finally:
        os.close(fd)
    return directory


def _in_directory(cwd: str, argv: Sequence[str]) -> list[str]:
    """Pure: ``argv`` started in ``cwd``, changed into as the account, as systemd does for the unit (one
    the account may not enter, such as a user manager's home for a unit that drops to the account
    itself: ``/``, said on its standard error)."""
    fallback = 'echo "safeinstall: $1 cannot be entered: running in /" >&2; cd /'
    return [
        "/bin/sh",
        "-c",
        f'cd -- "$1" 2>/dev/null || {{ {fallback}; }}; shift; exec "$@"',
        "sh",
        cwd,
        *argv,
    ]


def run_imports(
    python: Path,
    context: Context,
    variables: Mapping[str, str],
    sites: Sequence[Path],
    package: str,
    changed: Iterable[str],
    timeout: float,
    cancel: threading.Event | None = None,
    wanted: Wanted = Wanted(),
) -> ChildOutcome:
    """The import child for one context (see the module); ``cancel``: see :func:`_run`; ``wanted``:
    what else it imports, or leaves out."""
    spec = json.dumps(
        {
            "sites": [str(s) for s in sites],
            "package": package,
            "changed": sorted(changed),
            "run": list(wanted.run),
            "scripts": list(wanted.scripts),
            "skip": list(wanted.skip),
            "also": list(wanted.also),
        }
    )
    argv = _in_directory(context.cwd, [str(python), "-c", CHILD_SCRIPT, spec])
    proc, problem = _run(argv, variables, context.run_as, timeout, cancel)
    if proc is None:
        return ChildOutcome("imports", context, False, (), (), problem, ())
    imported, failed, started, done, unavailable = read_answers(proc.stdout)
    owners, skipped, must = read_details(proc.stdout)
    stderr = tail(proc.stderr)
    if started is not None:
        problem = f"it died while importing {started} (exit {_status(proc.returncode)})"
    elif not done:
        problem = f"it ended before it was done (exit {_status(proc.returncode)})"
    ok = not failed and problem is None and proc.returncode == 0
    return ChildOutcome(
        "imports", context, ok, imported, failed, problem, stderr, unavailable, owners, skipped, must=must
    )


def run_command(
    command: str,
    context: Context,
    variables: Mapping[str, str],
    timeout: float,
    cancel: threading.Event | None = None,
) -> ChildOutcome:
    """The operator's ``--smoke`` command for one context, through ``/bin/sh -c``: exit 0 passes."""
    argv = _in_directory(context.cwd, ["/bin/sh", "-c", command])
    proc, problem = _run(argv, variables, context.run_as, timeout, cancel)
    if proc is None:
        return ChildOutcome(command, context, False, (), (), problem, ())
    if proc.returncode != 0:
        problem = f"exit {_status(proc.returncode)}"
    return ChildOutcome(command, context, proc.returncode == 0, (), (), problem, tail(proc.stderr))


def _status(code: int) -> str:
    return f"{code}" if code >= 0 else f"{code}, killed by signal {-code}"


#: What a child ended because the run stopped says (its outcome is never the run's answer).
CANCELLED = "it was ended: the run stopped before the check was done"


def _run(
    argv: Sequence[str],
    variables: Mapping[str, str],
    run_as: RunAs | None,
    timeout: float,
    cancel: threading.Event | None = None,
) -> tuple[subprocess.CompletedProcess[str] | None, str | None]:
    """The child run (``cancel``: set by the run when it stops while the check runs in the background,
    :mod:`safeinstall.run.steps.smoke`: the child and its group are ended); None and why, when it ran too
    long, printed too much, could not start or was cancelled."""
    try:
        proc = children.run(
            argv,
            env=variables,
            timeout=timeout,
            as_user=None if run_as is None else run_as.ids,
            groups=() if run_as is None else run_as.groups,
            limit=OUTPUT_LIMIT,
            end_group=True,  # what an import started (vLLM's, torch's helpers) never outlives the check
            contain=True,  # nor what left the group (setsid): a PID namespace of its own (issue 44)
            cancel=cancel,
        )
    except children.Cancelled:
        return None, CANCELLED
    except subprocess.TimeoutExpired:
        return None, f"it did not finish in {timeout:g} s {TIMED_OUT}; it was ended"
    except children.TooMuchOutput as exc:
        return None, f"it was ended: {exc}"
    except OSError as exc:
        return None, f"it could not start: {exc.strerror or exc}"
    return proc, None


#: The probe of what a unit's user must reach: each ``x:PATH`` it must execute, each ``d:PATH`` (a
#: directory) it must list and enter; the first it may not is printed, and the probe fails.
_REACH_SCRIPT = (
    'for p do case $p in x:*) test -x "${p#x:}";; *) test -r "${p#d:}" && test -x "${p#d:}";; esac '
    '|| { printf "%s\\n" "${p#?:}"; exit 1; }; done'
)


def reach_problem(run_as: RunAs, executables: Sequence[Path], directories: Sequence[Path]) -> str | None:
    """Whether ``run_as`` (its groups too: the kernel's own answer, access control lists included) may
    run ``executables`` and list and enter ``directories``, asked in a child that is that account (a
    shell's ``test``); None when it may, else the first path it may not reach, said. A directory that
    is not there (a platlib the interpreter names but never made) is not asked about."""
    argv = ["/bin/sh", "-c", _REACH_SCRIPT, "sh"]
    argv += [f"x:{p}" for p in executables] + [f"d:{p}" for p in directories if os.path.isdir(p)]
    proc, problem = _run(argv, {"PATH": DEFAULT_PATH}, run_as, 30.0)
    if proc is None:
        return f"{run_as.name} could not be asked what it reaches: {problem}"
    if proc.returncode == 0:
        return None
    first = tail(proc.stdout, 1)
    return f"{run_as.said()} cannot reach {first[0] if first else 'what the check needs'}"


def others_may_write(top: Path) -> str | None:
    """Whether anyone but root could change something in ``top`` (a tree of the new version root made:
    the staging tree, the prefetch's): the first entry not root's, or that its group (any, root's
    included: an access list's mask) or everyone may write, said; None: root's alone. Before the tree
    is opened to a unit's user (by descriptor, no symlink followed)."""
    with Tree(top) as tree:
        files, directories = tree.walk("")
        with tree.batch():
            for relative in ["", *directories, *files]:
                info = tree.lstat(relative) if relative else os.fstat(tree.fd)
                if info is None:
                    continue
                writer = others_who_write(info.st_mode, info.st_gid, group_root_is_root=False)
                if info.st_uid != 0 or (writer is not None and not stat.S_ISLNK(info.st_mode)):
                    return f"{top / relative} is not root's alone ({writer or f'uid {info.st_uid}'})"
    return None
