"""Installed distributions: found through their ``.dist-info`` directories, RECORD parsed once."""

from __future__ import annotations

import difflib
import errno
import io
import os
import stat
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from safeinstall.env.drift import own_roots
from safeinstall.env.environment import Environment, distribution_sites
from safeinstall.env.records import Record, RecordEntry, count_lines, parse_record
from safeinstall.errors import RecordError, UnknownDistributionError
from safeinstall.system.safefs import read_small, read_small_unless


@dataclass(frozen=True, slots=True)
class InstalledDistribution:
    name: str  # canonical (PEP 503)
    display_name: str
    version: str
    site: Path  # the directory holding the .dist-info; RECORD paths are relative to it
    dist_info: Path
    record: Record
    console_scripts: tuple[str, ...]
    installer: str | None
    #: where each RECORD entry lives, normalised lexically (``../../../bin/x`` -> ``<prefix>/bin/x``);
    #: parallel to ``record.entries``, computed once
    locations: tuple[str, ...]
    #: its ``Requires-Dist`` headers, as written (markers included); read, never evaluated here
    requires: tuple[str, ...] = ()
    #: why its RECORD could not be read (then ``record`` is empty): :data:`NO_RECORD` when there is
    #: none, else the reason (a FIFO, larger than the limit, not readable by the environment's owner)
    record_problem: str | None = None


def entry_location(site: Path | str, entry: RecordEntry) -> str:
    """Where an entry lives, as uv (the installer that removes it) takes it: relative to ``site``, a
    leading "/" dropped (uv removes ``site-packages/etc/x`` for ``/etc/x``), normalised lexically."""
    path = entry.path
    if path[:1] != "/" and "//" not in path and "/." not in path and path[:1] != "." and path[-1:] != "/":
        return f"{os.fspath(site)}/{path}"  # already normal: skip normpath (a torch RECORD has 15k)
    return os.path.normpath(os.path.join(site, path.lstrip("/")))


def plain_locations(site: str, entries: Sequence[RecordEntry], paths: list[str]) -> tuple[str, ...] | None:
    """Pure: :func:`entry_location` of each entry (``paths``: theirs). Each is ``site/path``, joined
    without a Python call per entry (vLLM: 61k), but those that need normalising (a leading "/" or
    ".", a "//" or "/.", a trailing "/"), found by searching all the paths joined by NUL (which no
    path holds); None where more than :data:`_ODD_PATHS` marks are found."""
    joined = "\0".join(paths)
    marks: list[int] = []  # where each mark's path begins to show it: its index counted below
    for mark in ("//", "/.", "\0/", "\0.", "/\0"):
        at = joined.find(mark)
        while at != -1:
            if len(marks) >= _ODD_PATHS:
                return None
            marks.append(at + 1 if mark[0] == "\0" else at)
            at = joined.find(mark, at + 1)
    odd: set[int] = set()
    index = counted = 0
    for at in sorted(marks):
        index += joined.count("\0", counted, at)
        counted = at
        odd.add(index)
    if joined[:1] in ("/", "."):
        odd.add(0)
    if joined[-1:] == "/":
        odd.add(len(paths) - 1)
    located = list(map(f"{site}/".__add__, paths))
    for index in odd:
        located[index] = entry_location(site, entries[index])
    return tuple(located)


#: The most of an installed METADATA or INSTALLER that is read (a wheel's are refused beyond the same),
#: of an installed entry_points.txt (the largest on PyPI are tens of KiB; read for each distribution,
#: and how many there are is the environment owner's choice), and of a RECORD (torch's is 2 MB)
METADATA_LIMIT = 16 << 20
ENTRY_POINTS_LIMIT = 1 << 20
RECORD_LIMIT = 64 << 20


#: The most of an environment's ``.dist-info`` files one scan reads in all (bytes), and the most RECORD
#: lines it parses (a large vLLM environment's RECORDs hold about 20 MB in 150k lines): their owner
#: decides how many there are (hardlinks make them free), and a parsed line costs root hundreds of
#: bytes of memory, however short it is.
SCAN_LIMIT = 128 << 20
SCAN_LINES_LIMIT = 1_000_000

#: A distribution's RECORD problem when it has none.
NO_RECORD = "missing"

#: The most paths of one RECORD :func:`plain_locations` finds to normalise one by one (scripts'
#: ``../../../bin/x``); beyond, every path is.
_ODD_PATHS = 4096
#: A RECORD's identity as read: device, inode, size, mtime and ctime (ns) of the descriptor read.
RecordIdentity = tuple[int, int, int, int, int]
#: A parse is kept only of a RECORD whose ctime is this much older than the moment it was read: a
#: write just after the read could leave the same coarse ctime (the verified-inode store's rule).
SETTLED_NS = 2_000_000_000


@dataclass(frozen=True, slots=True)
class KeptParse:
    """A RECORD as an earlier check parsed it: its identity then, its line count (the scan's limit
    counts them), and what it lists."""

    identity: RecordIdentity
    lines: int
    record: Record
    #: where each entry lives (:func:`entry_location`), when worked out as it was read back
    locations: tuple[str, ...] | None = None


class ParsedRecords:
    """The RECORDs earlier checks parsed (by the RECORD's path), believed for a RECORD whose identity
    (device, inode, size, mtime, ctime) is the same now; what this check parsed anew (``fresh``). A
    RECORD rewritten since, even to the same size with its mtime set back, has another ctime: parsed
    again. ``seen``: this check's, taken or parsed anew (``new``: how many parsed anew). docs/verify.md."""

    __slots__ = ("kept", "new", "seen", "use")

    def __init__(self, kept: Mapping[str, KeptParse], use: bool = True) -> None:
        self.kept = kept
        self.use = use  # False (``--full``): every RECORD read, the parses kept anew
        self.seen: dict[str, KeptParse] = {}
        self.new = 0

    def known(self, path: str) -> KeptParse | None:
        return self.kept.get(path) if self.use else None

    def parsed(
        self, path: str, info: os.stat_result | None, lines: int, record: Record, read_ns: int
    ) -> None:
        """A RECORD read and parsed now (``info``: its descriptor's fstat, unchanged over the read; None
        when it moved): kept when its ctime settled before ``read_ns``, the clock read before it."""
        if info is not None and info.st_ctime_ns + SETTLED_NS <= read_ns:
            identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
            self.seen[path] = KeptParse(identity, lines, record)
            self.new += 1


class MetadataReader:
    """Reads one environment's ``.dist-info`` files for one scan: only a regular file within its limit that
    ``account`` may read, and at most :data:`SCAN_LIMIT` bytes in all (then RecordError), since the
    owner can add RECORDs without end."""

    __slots__ = ("account", "left", "lines_left", "parses")

    def __init__(
        self,
        account: tuple[int, int] | None = None,
        total: int = SCAN_LIMIT,
        lines: int = SCAN_LINES_LIMIT,
        parses: ParsedRecords | None = None,
    ) -> None:
        self.account = account
        self.left = total
        self.lines_left = lines
        self.parses = parses

    @classmethod
    def of(cls, env: Environment, parses: ParsedRecords | None = None) -> MetadataReader:
        """A reader for one scan of ``env``, as its owner (the limits as they are now); ``parses``: the
        RECORDs earlier checks parsed."""
        ids = env.account.ids if env.account is not None else None
        return cls(ids, SCAN_LIMIT, SCAN_LINES_LIMIT, parses)

    def record(self, path: Path) -> tuple[Record, str | None]:
        """A RECORD parsed (or as an earlier check parsed it, its identity unchanged), or an empty one and
        why it could not be read (:data:`NO_RECORD`: there is none). Its lines are counted before they
        are split (RecordError beyond the scan's limit)."""
        if self.parses is not None:
            return self._record_kept(path, self.parses)
        text, problem = self.text_or_why(path, RECORD_LIMIT)
        if text is None:
            return parse_record(""), problem
        return parse_record(self._count(path, text)), None

    def locations(self, path: Path, record: Record, site: str) -> tuple[str, ...]:
        """Where each entry of ``record`` (the RECORD at ``path``, as :meth:`record` gave it) lives."""
        kept = None if self.parses is None else self.parses.seen.get(os.fspath(path))
        if kept is not None and kept.record is record and kept.locations is not None:
            return kept.locations
        return tuple(entry_location(site, entry) for entry in record.entries)

    def _count(self, path: Path, text: str) -> str:
        lines = count_lines(text)
        if lines > self.lines_left:
            raise _over_the_scan(
                path, f"the RECORDs in {path.parent.parent} list more than {SCAN_LINES_LIMIT} files"
            )
        self.lines_left -= lines
        return text

    def _record_kept(self, path: Path, parses: ParsedRecords) -> tuple[Record, str | None]:
        """:meth:`record`, a kept parse taken where the descriptor's identity is the one kept (checked as a
        read is: a regular file its owner may read, within the limits, its bytes and lines counted)."""
        key = os.fspath(path)
        kept = parses.known(key)
        allowed = min(RECORD_LIMIT, self.left)

        def known(info: os.stat_result) -> bool:
            identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
            return kept is not None and identity == kept.identity and kept.lines <= self.lines_left

        read_ns = time.time_ns()  # before the fstat: a ctime settled by then is kept
        try:
            data, info = read_small_unless(path, allowed, self.account, known)
        except FileNotFoundError:
            return parse_record(""), NO_RECORD
        except OSError as exc:
            if exc.errno == errno.EFBIG and allowed < RECORD_LIMIT:
                what = f"the .dist-info files in {path.parent.parent} hold more than {SCAN_LIMIT} bytes"
                raise _over_the_scan(path, what) from exc
            return parse_record(""), exc.strerror or str(exc)
        if data is None and kept is not None:
            self.left -= kept.identity[2]
            self.lines_left -= kept.lines
            parses.seen[key] = kept  # still this environment's
            return kept.record, None
        assert data is not None
        self.left -= len(data)
        text = self._count(path, data.decode("utf-8", errors="replace"))
        record = parse_record(text)
        if info is not None and stat.S_ISREG(info.st_mode):
            parses.parsed(key, info, count_lines(text), record, read_ns)
        return record, None

    def text(self, path: Path, limit: int = METADATA_LIMIT) -> str | None:
        """The file's text; None where it could not be read, as for a missing file."""
        return self.text_or_why(path, limit)[0]

    def text_or_why(self, path: Path, limit: int) -> tuple[str | None, str | None]:
        """The file's text, or None and why not (:data:`NO_RECORD` when it is not there)."""
        allowed = min(limit, self.left)
        try:
            data = read_small(path, allowed, self.account)
        except FileNotFoundError:
            return None, NO_RECORD
        except OSError as exc:
            if exc.errno == errno.EFBIG and allowed < limit:
                what = f"the .dist-info files in {path.parent.parent} hold more than {SCAN_LIMIT} bytes"
                raise _over_the_scan(path, what) from exc
            return None, exc.strerror or str(exc)
        self.left -= len(data)
        return data.decode("utf-8", errors="replace"), None


def _over_the_scan(path: Path, what: str) -> RecordError:
    """A scan that stops at one of its limits, reading ``path``."""
    return RecordError(
        f"{what} in all (reading {path})",
        hint=f"look for copies of .dist-info directories in {path.parent.parent} (its owner can make them)",
    )


_SCRIPT_SECTIONS = frozenset({"console_scripts", "gui_scripts"})


def parse_console_scripts(entry_points: str | None) -> tuple[str, ...]:
    """Pure: the names in ``[console_scripts]`` and ``[gui_scripts]`` of an ``entry_points.txt``, read as
    configparser reads it, a line at a time: configparser and importlib.metadata cost seconds and GB on
    a hostile file (docs/threat-model.md)."""
    if not entry_points:
        return ()
    names: set[str] = set()
    section: str | None = None
    for raw in io.StringIO(entry_points, newline="\n"):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if raw[0] in " \t" and section is not None:
            continue  # a continuation of the previous value
        if line[0] == "[":
            end = line.rfind("]")
            section = line[1:end] if end > 1 else None
            continue
        if section in _SCRIPT_SECTIONS:
            name, equals, _value = line.partition("=")
            if equals and name.strip():
                names.add(name.strip())
    return tuple(sorted(names))


def metadata_headers(text: str, wanted: tuple[str, ...]) -> dict[str, str]:
    """Pure: the first value of each ``wanted`` header of core metadata (RFC 822 style; the headers
    end at the first empty line, the long description after it is never scanned)."""
    found: dict[str, str] = {}
    lowered = {name.lower(): name for name in wanted}
    for line in text.splitlines():
        if not line.strip():
            break
        if line[:1] in (" ", "\t"):
            continue  # a folded continuation of the previous header
        key, sep, value = line.partition(":")
        name = lowered.get(key.strip().lower())
        if sep and name is not None and name not in found:
            found[name] = value.strip()
    return found


def metadata_values(text: str, wanted: str) -> tuple[str, ...]:
    """Pure: every value of the header ``wanted`` (``Requires-Dist`` repeats), in the order written."""
    values: list[str] = []
    lowered = wanted.lower()
    for line in text.splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and line[:1] not in (" ", "\t") and key.strip().lower() == lowered:
            values.append(value.strip())
    return tuple(values)


def load_distribution(dist_info: Path, reader: MetadataReader | None = None) -> InstalledDistribution | None:
    """Read one ``.dist-info`` directory; None if it is not a readable distribution. ``reader``: the
    scan's (reads only what the environment's owner may read; a default one reads as this process)."""
    reader = reader or MetadataReader()
    metadata = reader.text(dist_info / "METADATA")
    if metadata is None:
        return None
    headers = metadata_headers(metadata, ("Name", "Version"))
    name = headers.get("Name")
    version = headers.get("Version")
    if not name or not version:
        return None
    record, record_problem = reader.record(dist_info / "RECORD")
    installer = reader.text(dist_info / "INSTALLER")
    site = dist_info.parent
    site_text = os.fspath(site)
    return InstalledDistribution(
        name=canonicalize_name(name),
        display_name=name,
        version=version,
        site=site,
        dist_info=dist_info,
        record=record,
        console_scripts=parse_console_scripts(
            reader.text(dist_info / "entry_points.txt", ENTRY_POINTS_LIMIT)
        ),
        installer=installer.strip() if installer else None,
        locations=reader.locations(dist_info / "RECORD", record, site_text),
        requires=metadata_values(metadata, "Requires-Dist"),
        record_problem=record_problem,
    )


def dist_info_dirs(env: Environment) -> list[Path]:
    """Every ``*.dist-info`` directory in the environment's own site directories (where uv installs),
    in scan order."""
    return _dist_info_dirs_in(env.site_dirs)


def every_dist_info_dir(env: Environment) -> list[Path]:
    """Every ``*.dist-info`` directory the interpreter imports from, in ``sys.path`` order: its own site
    directories, then the base installation's (:func:`~safeinstall.env.environment.distribution_sites`)."""
    return _dist_info_dirs_in(distribution_sites(env))


def egg_info_paths(env: Environment) -> list[Path]:
    """Every ``*.egg-info`` (a directory or a file: setup.py installs, many of a Linux distribution's own
    packages) in the site directories the interpreter imports from: distributions without a RECORD,
    that nothing here can check."""
    found: list[Path] = []
    for site in distribution_sites(env):
        try:
            with os.scandir(site) as listing:
                found.extend(sorted(Path(e.path) for e in listing if e.name.endswith(".egg-info")))
        except OSError:
            continue
    return found


def _dist_info_dirs_in(sites: Sequence[Path]) -> list[Path]:
    found: list[Path] = []
    for site in sites:
        try:
            children = sorted(os.scandir(site), key=lambda e: e.name)
        except OSError:
            continue
        found.extend(
            Path(c.path)
            for c in children
            if c.name.endswith(".dist-info") and c.is_dir(follow_symlinks=False)
        )
    return found


def dist_info_name(dirname: str) -> str | None:
    """Pure: the canonical distribution name of a ``<name>-<version>.dist-info`` directory name."""
    if not dirname.endswith(".dist-info"):
        return None
    stem = dirname[: -len(".dist-info")]
    name = stem.rsplit("-", 1)[0] if "-" in stem else stem
    return canonicalize_name(name) if name else None


def reload_distributions(
    env: Environment, previous: Sequence[InstalledDistribution], names: Collection[str]
) -> list[InstalledDistribution]:
    """The environment's distributions after an install that changed only ``names``: those are read
    again from disk (new RECORDs, new versions, gone), the others are taken from ``previous``."""
    changed = frozenset(names)
    found: dict[str, InstalledDistribution] = {d.name: d for d in previous if d.name not in changed}
    directories = [d for d in every_dist_info_dir(env) if dist_info_name(d.name) in changed]
    found = _first_of_each(directories, found, MetadataReader.of(env))
    return sorted(found.values(), key=lambda d: d.name)


def _first_of_each(
    directories: Sequence[Path],
    found: dict[str, InstalledDistribution],
    reader: MetadataReader,
    loaded: Sequence[InstalledDistribution] = (),
) -> dict[str, InstalledDistribution]:
    """``found`` with the first distribution of each name read from ``directories`` (in their order)
    added; a directory of ``loaded`` is not read again."""
    known = {d.dist_info: d for d in loaded}
    for directory in directories:
        dist = known.get(directory) or load_distribution(directory, reader)
        if dist is not None and dist.name not in found:
            found[dist.name] = dist
    return found


def find_distributions(
    env: Environment, loaded: Sequence[InstalledDistribution] = (), reader: MetadataReader | None = None
) -> list[InstalledDistribution]:
    """Every distribution installed in the environment's site directories, sorted by name; a directory
    of ``loaded`` (read just before, by :func:`find_named`) is not read again. ``reader``: the scan's
    (its limits shared with :func:`find_named`'s part of it), else a new one."""
    found = _first_of_each(every_dist_info_dir(env), {}, reader or MetadataReader.of(env), loaded)
    return sorted(found.values(), key=lambda d: d.name)


def find_named(
    env: Environment, names: Collection[str], reader: MetadataReader | None = None
) -> list[InstalledDistribution] | None:
    """Only the named distributions, found by their ``.dist-info`` directory names
    and read as :func:`find_distributions` reads them, in its scan order; None when one of them is not
    found so (its directory may be named otherwise: scan everything). A caller that scans everything
    later checks that it picks the same directories."""
    canonical = [canonicalize_name(name) for name in names]
    wanted = frozenset(canonical)
    directories = [d for d in every_dist_info_dir(env) if dist_info_name(d.name) in wanted]
    read = _first_of_each(directories, {}, reader or MetadataReader.of(env))
    found = {n: d for n, d in read.items() if n in wanted}
    return [found[name] for name in canonical] if len(found) == len(wanted) else None


def find_distribution(
    env: Environment, name: str, installed: Sequence[InstalledDistribution]
) -> InstalledDistribution:
    """``name`` among the environment's distributions (found once per run: ``installed``), or a
    usage error that names the closest ones."""
    wanted = canonicalize_name(name)
    for dist in installed:
        if dist.name == wanted:
            return dist
    close = difflib.get_close_matches(wanted, [d.name for d in installed], n=3, cutoff=0.6)  # best first
    guess = f"; did you mean {' or '.join(close)}?" if close else ""
    raise UnknownDistributionError(
        f"{name} is not installed in {env.prefix}{guess}",
        hint=f"check the name, or pass --python for the environment that has it "
        f"(looked in {', '.join(str(s) for s in distribution_sites(env))})",
    )


def package_roots(env: Environment, installed: Sequence[InstalledDistribution]) -> dict[str, list[str]]:
    """Each installed distribution's own package directories (:func:`safeinstall.env.drift.own_roots`: no
    other distribution has files below them) in the sites the interpreter imports from: the one
    answer verification (what is "extra"), the backup (what it saves besides the RECORD) and the
    wheel check (whose directories a new wheel writes into) use."""
    sites = [os.fspath(site) for site in distribution_sites(env)]
    return own_roots({d.name: d.locations for d in installed}, sites)
