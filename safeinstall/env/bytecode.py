"""Bytecode judged by what it runs: a ``.pyc`` is fine only when it holds the code its verified source
compiles to. Nothing of it is run (``marshal.loads`` builds data).

:func:`judge` is pure, :func:`judge_files` reads; docs/verify.md."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import marshal
import os
import resource
import stat
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from safeinstall.env.records import encode_digest

if TYPE_CHECKING:
    from safeinstall.system.safefs import Tree

#: No ``.pyc`` or source larger than this is unmarshalled or compiled (the largest of vLLM's is 2 MiB).
LARGEST_PYC = 32 << 20
LARGEST_SOURCE = 32 << 20

#: PEP 552's flags: bit 0, a hash-based ``.pyc``; bit 1, check the source (a checked one).
_HASH_BASED = 0b01
_CHECK_SOURCE = 0b10
_HEADER = 16


class PycName(NamedTuple):
    """What a ``__pycache__`` file's name says: its source, the interpreter's tag, the optimization."""

    source: str  # absolute: ``pkg/__pycache__/mod.cpython-311.opt-1.pyc`` -> ``pkg/mod.py``
    tag: str  # ``cpython-311``
    optimize: int  # 0, 1 or 2


def pyc_name(location: str) -> PycName | None:
    """Pure: the parts of a ``__pycache__`` ``.pyc``'s path, or None for any other path (a name Python
    never loads from ``__pycache__``: not ``NAME.TAG.pyc`` nor ``NAME.TAG.opt-N.pyc``)."""
    directory, _, name = location.rpartition("/")
    parent, _, cache = directory.rpartition("/")
    if cache != "__pycache__" or not name.endswith(".pyc"):
        return None
    parts = name[: -len(".pyc")].split(".")
    optimize = 0
    if len(parts) == 3 and parts[2] in ("opt-1", "opt-2"):
        optimize = int(parts[2][-1])
        parts = parts[:2]
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return PycName(f"{parent}/{parts[0]}.py", parts[1], optimize)


@dataclass(frozen=True, slots=True)
class Header:
    magic: bytes
    flags: int
    mtime: int  # timestamp .pyc: the source's mtime (seconds, 32 bits); else 0
    size: int  # timestamp .pyc: the source's size (32 bits); else 0
    source_hash: bytes  # hash-based .pyc: the source's SipHash; else b""


def parse_header(data: bytes) -> Header | str:
    """Pure: a ``.pyc``'s 16-byte header (PEP 552), or why it is not one."""
    if len(data) < _HEADER:
        return "shorter than a .pyc's header"
    flags = int.from_bytes(data[4:8], "little")
    if flags & ~(_HASH_BASED | _CHECK_SOURCE) or flags == _CHECK_SOURCE:
        return f"flags {flags:#x} are no .pyc's"
    if flags & _HASH_BASED:
        return Header(data[:4], flags, 0, 0, data[8:16])
    return Header(
        data[:4], flags, int.from_bytes(data[8:12], "little"), int.from_bytes(data[12:16], "little"), b""
    )


#: marshal's types (Python/marshal.c, format 4 and 5): what follows each type byte. Fixed: so many
#: bytes; the others are read by :func:`marshal_bounded`.
_FIXED = {**dict.fromkeys(b"0NFTS.", 0), ord("i"): 4, ord("I"): 8, ord("g"): 8, ord("y"): 16, ord("r"): 4}
_SIZED = frozenset(b"stuaA")  # 4-byte length, then that many bytes
_SHORT = frozenset(b"zZ")  # 1-byte length, then that many bytes
_CONTAINERS = frozenset(b"([<>")  # 4-byte count, then that many objects
_FLAG_REF = 0x80


def marshal_bounded(data: bytes) -> str | None:
    """Pure: None when every count in the marshal stream ``data`` fits the bytes left, or why not
    (``marshal.loads`` allocates what a count says first: 5 hostile bytes, 16 GiB). Walked with its own
    stack; code objects as CPython 3.11 to 3.13 write them."""
    end = len(data)
    at = 0
    # what is still to be read, last first: [objects left] (-1: a dict's, until its NULL key) or
    # [-2 - n]: n raw bytes
    todo = [1]
    while todo:
        if todo[-1] == 0:
            todo.pop()
            continue
        if todo[-1] < -1:
            at += -2 - todo.pop()
            continue
        if at >= end:
            return "its body ends within an object"
        kind = data[at] & ~_FLAG_REF
        at += 1
        if todo[-1] > 0:
            todo[-1] -= 1
        elif kind == ord("0"):  # a dict's end
            todo.pop()
            continue
        else:  # a dict's key: its value follows
            todo.append(1)
        left = end - at
        if kind in _FIXED:
            at += _FIXED[kind]
        elif kind in _SIZED or kind == ord("l") or kind in _CONTAINERS:
            if left < 4:
                return "its body ends within an object"
            count = int.from_bytes(data[at : at + 4], "little", signed=True)
            at += 4
            size = abs(count) * 2 if kind == ord("l") else count
            if (count < 0 and kind != ord("l")) or size > end - at:
                return f"it says {count} items or bytes where {end - at} bytes are left"
            if kind in _CONTAINERS:
                todo.append(count)
            else:
                at += size
        elif kind in _SHORT or kind == ord("f"):
            at += 1 + (data[at] if left else 0)
        elif kind == ord("x"):  # two floats, each a 1-byte length and its text
            at += 1 + (data[at] if left else 0)
            at += 1 + (data[at] if at < end else 0)
        elif kind == ord(")"):
            todo.append(data[at] if left else 0)
            at += 1
        elif kind == ord("{"):
            todo.append(-1)
        elif kind == ord(":"):  # a slice: start, stop, step
            todo.append(3)
        elif kind == ord("c"):
            at += 20
            todo += [2, -2 - 4, 8]
        else:
            return f"type {kind:#x} is no marshal type"
        if at > end:
            return "its body ends within an object"
    return None


#: The running interpreter's tag and magic: a ``.pyc`` of another tag cannot be compared here.
OWN_TAG = sys.implementation.cache_tag
OWN_MAGIC = importlib.util.MAGIC_NUMBER


def judge(pyc: bytes, name: PycName, source: bytes) -> str | None:
    """Pure (builds code objects, runs none): why ``pyc`` is not the bytecode of ``source`` (its verified
    source's bytes), or None. An unchecked hash-based ``.pyc`` is never fine; the code must be what
    compiling the source gives; another interpreter's is judged by its header. docs/verify.md."""
    header = parse_header(pyc)
    if isinstance(header, str):
        return header
    if header.flags & _HASH_BASED and not header.flags & _CHECK_SOURCE:
        return "unchecked hash-based bytecode: Python runs it without looking at its source"
    if name.tag != OWN_TAG:
        return None  # another interpreter's: its header is all that can be judged here
    if header.magic != OWN_MAGIC:
        return f"magic {header.magic.hex()} is not {name.tag}'s"
    if marshal_bounded(pyc[_HEADER:]) is not None:
        return "its body is not marshalled code"
    try:
        held = marshal.loads(pyc[_HEADER:])
    except (EOFError, ValueError, TypeError, RecursionError, MemoryError):
        return "its body is not marshalled code"
    if type(held) is not type(judge.__code__):
        return "its body is not a code object"
    try:
        compiled = compile(source, name.source, "exec", dont_inherit=True, optimize=name.optimize)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return "its source does not compile"
    return None if held == compiled else "its code is not what its source compiles to"


class Source(NamedTuple):
    """A listed source a ``.pyc`` is judged against: its RECORD's hash."""

    algorithm: str
    digest: str


class Judged(NamedTuple):
    """One ``.pyc`` judged fine, as it was (what the store keeps: its identity and the source's hash)."""

    location: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    source_digest: str


#: Given a ``.pyc``'s ``lstat`` and its source's RECORD digest: True when it was judged fine before,
#: as it is now (its identity unchanged) against a source of that very hash.
KnownPyc = Callable[[os.stat_result, str], bool]


@dataclass(frozen=True, slots=True)
class Verdicts:
    problems: Mapping[str, str]  # location -> why it is not fine
    judged: tuple[Judged, ...]  # read and judged fine by this check (keepable)
    by_identity: int  # proven by the store, not read
    by_installer: int = 0  # written by its installer, untouched since: its header read, not compiled
    compiled: int = 0  # read, and judged against its compiled source (or by its header: another tag's)


#: A file's identity as a check saw it: (device, inode, size, mtime_ns, ctime_ns).
Identity = tuple[int, int, int, int, int]


def identity(info: os.stat_result) -> Identity:
    """Pure: what :data:`Identity` holds of a ``stat``."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def installer_written(ctime_ns: int, window: tuple[int, int]) -> bool:
    """Pure: a listed ``.pyc`` whose inode last changed within its distribution's install (``window``:
    the earliest change time of its listed files, and its RECORD's, as root first saw them): written by
    the installer that compiled and listed it, untouched since (change times, which no account sets;
    a rename or a link changes them too)."""
    return 0 < window[0] <= ctime_ns <= window[1]


def recorded_fine(header: bytes) -> bool:
    """Pure: a ``.pyc`` header of bytecode its installer wrote that needs no compile: a ``.pyc``'s, and
    not unchecked hash-based (Python would run it without looking at its source: judged whole, and
    reported)."""
    parsed = parse_header(header)
    return not isinstance(parsed, str) and not (
        parsed.flags & _HASH_BASED and not parsed.flags & _CHECK_SOURCE
    )


def judge_files(
    roots: Sequence[Path],
    candidates: Iterable[tuple[str, PycName, Source | None]],
    clean_sources: Callable[[str], bool],
    known: KnownPyc | None = None,
    installed: Mapping[str, tuple[int, int]] | None = None,
) -> Verdicts:
    """Each candidate ``.pyc`` below ``root`` judged, read by descriptor within the first of ``roots`` that
    holds it; its source's bytes must match its RECORD hash before they are compiled. ``clean_sources``:
    sources the check found clean; ``installed``: a listed ``.pyc``'s install window, within which it is
    judged by its header alone (:func:`installer_written`)."""
    from safeinstall.system.safefs import NotRegularFile, Tree

    problems: dict[str, str] = {}
    judged: list[Judged] = []
    proven = by_installer = compiled = 0
    batch: list[tuple[Judged, PycName, bytes, bytes]] = []
    held = 0
    with contextlib.ExitStack() as stack:
        trees: list[Tree] = []
        for root in roots:
            with contextlib.suppress(OSError):
                opened = stack.enter_context(Tree(root))
                stack.enter_context(opened.batch())
                trees.append(opened)
        for location, name, source in candidates:
            tree, relative = next(
                ((t, r) for t in trees if (r := t.relative(location)) is not None), (None, None)
            )
            if tree is None or relative is None:
                problems[location] = "outside the environment"
                continue
            if source is None:
                problems[location] = f"bytecode of {os.path.basename(name.source)}, which no RECORD lists"
                continue
            info = tree.lstat(relative)
            if info is None:
                continue  # gone meanwhile
            if known is not None and clean_sources(name.source) and known(info, source.digest):
                proven += 1
                continue
            window = None if installed is None else installed.get(location)
            if (
                window is not None
                and installer_written(info.st_ctime_ns, window)
                and clean_sources(name.source)
                and _directory_untouched(tree, name.source, window[1])
            ):
                try:
                    header, header_info = _read_header(tree, relative)
                except (OSError, ValueError):
                    header, header_info = b"", info
                if identity(header_info) == identity(info) and recorded_fine(header):
                    by_installer += 1  # kept as judged: a later check proves it by identity
                    judged.append(Judged(location, *identity(info), source.digest))
                    continue
            try:
                pyc, pyc_info = _read(tree, relative, LARGEST_PYC)
                source_relative = tree.relative(name.source)
                if source_relative is None:
                    raise NotRegularFile(name.source, "outside the environment")
                text, _ = _read(tree, source_relative, LARGEST_SOURCE)
            except (OSError, ValueError) as exc:
                problems[location] = f"could not be judged: {exc}"
                continue
            if encode_digest(hashlib.new(source.algorithm, text).digest()) != source.digest:
                problems[location] = (
                    f"bytecode of {os.path.basename(name.source)}, which is not as its RECORD says"
                )
                continue
            batch.append((Judged(location, *identity(pyc_info), source.digest), name, pyc, text))
            compiled += 1
            held += len(pyc) + len(text)
            if held >= BATCH_BYTES:
                _judge_batch(batch, problems, judged)
                batch, held = [], 0
        _judge_batch(batch, problems, judged)
    return Verdicts(problems, tuple(judged), proven, by_installer, compiled)


#: The bytes of bytecode and sources read before they are judged (in forked children, each a share).
BATCH_BYTES = 64 << 20
#: What a judging child may map beyond what it had at the fork: ``compile()`` of the owner's densest
#: source takes about 400 bytes a byte (8 MiB of ``x = 1`` lines: 3.4 GiB; 32 MiB: 13 GiB).
JUDGE_MEMORY = 4 << 30
#: Said of each ``.pyc`` of a judging child that died (past :data:`JUDGE_MEMORY`) or was never forked.
NOT_JUDGED = "could not be judged: its judge ran out of memory or could not be started"


def _judge_share(share: list[tuple[int, PycName, bytes, bytes]]) -> list[tuple[int, str | None]]:
    """Pure: :func:`judge` of each (in a forked child: compiling is CPU-bound, and threads share one)."""
    return [(index, judge(pyc, name, text)) for index, name, pyc, text in share]


def _bound_memory() -> None:
    """In a judging child: what it may map, bounded (:data:`JUDGE_MEMORY` more than it has)."""
    with open("/proc/self/statm", "rb") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + JUDGE_MEMORY, mapped + JUDGE_MEMORY))


#: The spawned judge: this interpreter, isolated (``-I``: no variable, no user site, no working
#: directory on its path), safeinstall's own directory given; its memory bounded, as a forked one's.
_SPAWNED = (
    "import pickle, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from safeinstall.env import bytecode\n"
    "bytecode._bound_memory()\n"
    "answers = bytecode._judge_share(pickle.load(sys.stdin.buffer))\n"
    "sys.stdout.buffer.write(pickle.dumps(answers))\n"
)


def _judge_spawned(items: list[tuple[int, PycName, bytes, bytes]]) -> list[tuple[int, str | None]]:
    """:func:`_judge_share` in a spawned child (where a fork could deadlock); one that fails is said of
    each (:data:`NOT_JUDGED`), never redone here."""
    import pickle
    import subprocess

    home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _SPAWNED, home],
            input=pickle.dumps(items, pickle.HIGHEST_PROTOCOL),
            capture_output=True,
            env={},
            cwd="/",
            check=False,
        )
        if done.returncode == 0:
            answers: list[tuple[int, str | None]] = pickle.loads(done.stdout)
            return answers
    except (OSError, pickle.UnpicklingError, EOFError):
        pass
    return [(index, NOT_JUDGED) for index, _, _, _ in items]


def _judge_batch(
    batch: list[tuple[Judged, PycName, bytes, bytes]], problems: dict[str, str], judged: list[Judged]
) -> None:
    """Each of ``batch`` judged, in forked children whose memory is bounded where no other thread runs
    (:func:`safeinstall.system.forking.map_forked`), never in this, root's, process: the owner's source
    and bytecode are what is compiled and unmarshalled, and a child that dies is said, not redone here
    (the attacker review); the answers into ``problems`` and ``judged``."""
    from safeinstall.system.forking import can_fork, cpu_count, map_forked, split

    items = [(index, name, pyc, text) for index, (_, name, pyc, text) in enumerate(batch)]
    if not items:
        return
    if can_fork():
        parent = os.getpid()

        def bounded(share: list[tuple[int, PycName, bytes, bytes]]) -> list[tuple[int, str | None]]:
            if os.getpid() == parent:  # map_forked redoes a failed child's share here: never
                return [(index, NOT_JUDGED) for index, _, _, _ in share]
            _bound_memory()
            return _judge_share(share)

        shares = [s for s in split(items, min(cpu_count(), 32)) if s]
        answers = dict(a for share in map_forked(bounded, [[], *shares]) for a in share)
    else:  # another thread runs (a fork could deadlock): a child of this interpreter, spawned
        answers = dict(_judge_spawned(items))
    for index, (fine, _, _, _) in enumerate(batch):
        why = answers[index]
        if why is None:
            judged.append(fine)
        else:
            problems[fine.location] = why


def _directory_untouched(tree: Tree, source: str, end_ns: int) -> bool:
    """The source's directory last changed within the install (ctime no later than ``end_ns``): a renamed
    ``__pycache__`` moves no ``.pyc``'s ctime, but it moves this one's (the attacker review)."""
    relative = tree.relative(os.path.dirname(source))
    info = None if relative is None else tree.lstat(relative)
    return info is not None and stat.S_ISDIR(info.st_mode) and 0 < info.st_ctime_ns <= end_ns


def _read_header(tree: Tree, relative: str) -> tuple[bytes, os.stat_result]:
    """A regular file's first 16 bytes (a ``.pyc``'s header) and its identity, the same after the read."""
    fd = tree.open_read(relative)
    try:
        info = os.fstat(fd)
        header = os.pread(fd, _HEADER, 0)
        if identity(os.fstat(fd)) != identity(info):
            raise ValueError("changed while it was read")
        return header, info
    finally:
        os.close(fd)


def _read(tree: Tree, relative: str, limit: int) -> tuple[bytes, os.stat_result]:
    """A regular file's bytes (at most ``limit``: ValueError beyond) and its identity before the read."""
    fd = tree.open_read(relative)
    try:
        info = os.fstat(fd)
        if info.st_size > limit:
            raise ValueError(f"larger than {limit} bytes")
        data = os.read(fd, info.st_size + 1)
        while len(data) <= info.st_size and (more := os.read(fd, info.st_size + 1 - len(data))):
            data += more
        after = os.fstat(fd)
        if len(data) != info.st_size or (after.st_mtime_ns, after.st_ctime_ns) != (
            info.st_mtime_ns,
            info.st_ctime_ns,
        ):
            raise ValueError("changed while it was read")
        return data, info
    finally:
        os.close(fd)


#: How long a judgement is believed (as the verified-inode store's hashes are).
MAX_AGE_NS = 24 * 3600 * 1_000_000_000
#: The most judgements kept (vLLM's environment holds about 25k ``.pyc`` files once it has run).
MAX_JUDGED = 1_000_000


def keepable(judged: Iterable[Judged], since_ns: int, granularity_ns: int) -> list[Judged]:
    """Pure: the judgements that may be kept: of a ``.pyc`` whose ctime (which no account sets) is older,
    by the timestamps' granularity, than the moment the check began: nothing changed it while it was
    judged, so an identity unchanged later means the bytes judged."""
    return [j for j in judged if j.ctime_ns + granularity_ns <= since_ns]


def known_checker(entries: Mapping[tuple[int, int], Judged]) -> KnownPyc:
    """What the check asks of a ``.pyc`` before reading it: judged fine before, its identity (device,
    inode, size, mtime, ctime) unchanged since, against a source of the very RECORD hash it has now."""

    def known(info: os.stat_result, source_digest: str) -> bool:
        kept = entries.get((info.st_dev, info.st_ino))
        return (
            kept is not None
            and kept.size == info.st_size
            and kept.mtime_ns == info.st_mtime_ns
            and kept.ctime_ns == info.st_ctime_ns
            and kept.source_digest == source_digest
        )

    return known


class Anchor(NamedTuple):
    """A distribution's install as root first saw it: its RECORD's inode and change time, and the
    earliest change time of its listed files then (:func:`installer_written`'s window)."""

    inode: int
    record_ctime_ns: int
    earliest_ns: int


def anchored_window(
    kept: Anchor | None, record: tuple[int, int] | None, earliest_ns: int | None
) -> tuple[tuple[int, int] | None, Anchor | None]:
    """Pure: the install window root trusts, and the anchor to keep (None: none new). First seen: anchored
    as it is (trust on first use); later the window kept, and none once the RECORD's inode or ctime
    changed (docs/verify.md). ``record``: its inode and ctime now; ``earliest_ns``: its files' earliest."""
    if record is None:
        return None, None
    if kept is None:
        if earliest_ns is None or not 0 < earliest_ns <= record[1]:
            return None, None
        return (earliest_ns, record[1]), Anchor(record[0], record[1], earliest_ns)
    if (kept.inode, kept.record_ctime_ns) != record:
        return None, None
    return (kept.earliest_ns, kept.record_ctime_ns), None
