"""The run's own copy of the wheel in the state directory: what is checked is what is installed.

A wheel in a directory others can write could be replaced after the check; the copy is root's,
readable only by the account uv runs as. docs/threat-model.md ("Files and wheels")."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safeinstall.env.containment import relative_path
from safeinstall.env.environment import Account
from safeinstall.errors import WheelError, one_line
from safeinstall.system.safefs import Tree, open_regular, reader_acl

WHEELS_DIR = "wheels"
COPY_DIR_MODE = 0o711
#: The copy when uv reads it as the environment's owner (the group class: the ACL's mask, or that
#: account's group without ACLs); else 0600.
READER_MODE = 0o640
PRIVATE_MODE = 0o600


def copy_access(
    account: Account | None, euid: int, egid: int, acls: bool = True
) -> tuple[int, tuple[int, int], bytes | None]:
    """Pure: the mode, (uid, gid) and access ACL of a copy of the wheel that only ``account`` (uv runs as
    it; None: as the caller, ``euid``/``egid``) may read besides the caller. ``acls``: the filesystem
    has them; else the account's group may read it."""
    if account is None:
        return PRIVATE_MODE, (euid, egid), None
    if acls:
        return READER_MODE, (euid, egid), reader_acl(account.uid)
    return READER_MODE, (euid, account.gid), None


def copy_wheel(source: Path, envdir: Path, account: Account | None) -> Path:
    """Copy ``source`` (a regular file: a FIFO or a device is refused) into ``envdir``, readable by
    ``account`` (see :func:`copy_access`); the copy's path."""
    directory = f"{WHEELS_DIR}/{os.getpid()}-{os.urandom(6).hex()}"
    try:
        source_fd = open_regular(source)
    except OSError as exc:
        raise WheelError(
            f"cannot read wheel {one_line(source)}: {exc.strerror or exc}",
            hint="check the path, or download/build the wheel again",
        ) from exc
    try:
        with Tree(envdir) as tree:
            tree.make_dirs(directory, COPY_DIR_MODE)
            tree.set_mode(WHEELS_DIR, COPY_DIR_MODE)  # made 0700 by an older release
            target = f"{directory}/{source.name}"
            mode, owner, acl = copy_access(account, os.geteuid(), os.getegid())
            try:
                tree.write_from(target, source_fd, mode, owner, atomic=False, acl=acl)
            except OSError as exc:
                if acl is None or exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                os.lseek(source_fd, 0, os.SEEK_SET)  # no ACLs here: the account's group reads it
                mode, owner, _ = copy_access(account, os.geteuid(), os.getegid(), acls=False)
                tree.write_from(target, source_fd, mode, owner, atomic=False)
    except OSError as exc:
        discard_wheel_copy(envdir / directory / source.name, envdir)
        raise WheelError(
            f"cannot copy the wheel {one_line(source)} into {envdir}: {exc.strerror or exc}; "
            "nothing was changed",
            hint=_copy_hint(exc, envdir),
        ) from exc
    finally:
        os.close(source_fd)
    return envdir / directory / source.name


def _copy_hint(exc: OSError, envdir: Path) -> str:
    """Pure: what to do when the copy of the wheel failed so."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free some space there (the run installs from its own copy of the wheel)"
    if exc.errno == errno.EFBIG:
        return "the wheel changed while it was copied: give a wheel that nobody else is writing"
    return (
        f"the run installs from its own copy of the wheel: make {envdir} writable by root, on a "
        "filesystem with POSIX ACLs when the environment is another account's"
    )


def _copy_dir(path: Path, envdir: Path) -> str | None:
    """Pure: ``wheels/<dir>`` when ``path`` is ``<envdir>/wheels/<dir>/<name>.whl``, else None."""
    try:
        parts = relative_path(path, envdir).parts
    except ValueError:
        return None
    if len(parts) != 3 or parts[0] != WHEELS_DIR or ".." in parts or not parts[2].endswith(".whl"):
        return None
    return f"{parts[0]}/{parts[1]}"


def is_wheel_copy(path: Path, envdir: Path) -> bool:
    """Pure: ``path`` names a run's copy of a wheel in ``envdir`` (anything else is never read)."""
    return _copy_dir(path, envdir) is not None


def discard_wheel_copy(path: Path, envdir: Path) -> None:
    """Remove a run's copy (best effort); a path that is not one is left alone."""
    directory = _copy_dir(path, envdir)
    if directory is None:
        return
    with contextlib.suppress(OSError), Tree(envdir) as tree:
        tree.remove_tree(directory)


def discard_dead_copies(envdir: Path) -> None:
    """Remove every run's copy in ``envdir`` (best effort): those of runs that died between copying the
    wheel and writing their journal, or whose recovery ended. Call it holding the environment's lock,
    with no journal left: then no run, live or to recover, uses one."""
    with contextlib.suppress(OSError), Tree(envdir) as tree:
        for name in tree.names(WHEELS_DIR):
            tree.remove_tree(f"{WHEELS_DIR}/{name}")


@contextlib.contextmanager
def passable_temporary_dir(what: str) -> Iterator[Path]:
    """A new temporary directory for ``what`` that others may enter but not list (0711), removed
    afterwards by descriptor: where a dry-run puts what uv, run as the environment's owner, reaches by
    name (a copy of the wheel, the ``--keep-patches`` scratch directory)."""
    try:
        top = Path(os.path.realpath(tempfile.mkdtemp(prefix="safeinstall-")))  # safefs opens real paths
    except OSError as exc:
        raise WheelError(
            f"cannot make a temporary directory for {what}: {exc.strerror or exc}",
            hint="uv runs as the environment's owner: free some space in the temporary directory (TMPDIR), "
            "or run without --dry-run",
        ) from exc
    try:
        os.chmod(top, COPY_DIR_MODE)
        yield top
    finally:
        with contextlib.suppress(OSError), Tree(top.parent) as tree:
            tree.remove_tree(top.name)


@contextlib.contextmanager
def temporary_copy(source: Path, account: Account) -> Iterator[Path]:
    """A copy of ``source`` in a :func:`passable_temporary_dir` that ``account`` may read (as
    :func:`copy_wheel` makes it): what a dry-run gives uv when uv runs as the environment's owner, who
    may not be able to read the wheel where it lies (a run gives it the run's own copy, in the state
    directory)."""
    with passable_temporary_dir(f"a copy of the wheel {source}") as top:
        yield copy_wheel(source, top, account)
