"""Which systemd unit a process belongs to, from the text of ``/proc/PID/cgroup``. Pure.

The deepest ``*.service`` on the path is its unit; a process with none is a stray that no unit can
stop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_USER_MANAGER = re.compile(r"user@(\d+)\.service")
#: systemd's unit_name_is_valid(): ``prefix[@instance].type`` over ``[A-Za-z0-9:_.\\-]``, at most 255
#: characters. Nothing else reaches systemctl: a name with ``*``, ``?`` or ``[`` would be a pattern there.
_UNIT_NAME = re.compile(
    r"[A-Za-z0-9:_.\\][A-Za-z0-9:_.\\-]*(@[A-Za-z0-9:_.\\-]*)?"
    r"\.(service|socket|device|mount|automount|swap|target|path|timer|slice|scope)"
)
UNIT_NAME_MAX = 255
#: Kernel suffix for a cgroup that was removed while a (zombie) process still referred to it.
_DELETED = " (deleted)"


@dataclass(frozen=True, slots=True)
class CgroupPlacement:
    path: str  # the cgroup path as the kernel shows it, e.g. "/system.slice/vllm.service/worker"
    unit: str | None  # the service the process belongs to, e.g. "vllm.service"; None: a stray
    scope: str | None  # for a stray: the deepest scope it sits in, e.g. "session-3.scope"
    user_manager_uid: int | None  # the unit (or scope) is inside user@UID.service: that UID
    #: the unit's own cgroup, e.g. "/system.slice/vllm.service": two processes share a unit only when
    #: this is equal (two managers may each run a "vllm.service"); None for a stray
    unit_path: str | None = None

    @property
    def is_stray(self) -> bool:
        """No service owns the process: stopping units will not stop it."""
        return self.unit is None


def parse_proc_cgroup(text: str) -> str | None:
    """The cgroup path from ``/proc/PID/cgroup`` text, or None when it names none. Prefers the cgroup v2 line
    (``0::/path``) when it is set and not the root, else the v1 ``name=systemd`` hierarchy (legacy and hybrid
    layouts), else the v2 root."""
    unified: str | None = None
    named: str | None = None
    for line in text.split("\n"):  # the kernel's own separator only: a cgroup name may hold U+2028
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        path = path.removesuffix(_DELETED)
        if not path.startswith("/"):
            continue
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "name=systemd" in controllers.split(","):
            named = path
    return unified if unified not in (None, "/") or named is None else named


def unescape_component(component: str) -> str:
    """Undo systemd's cgroup escaping (``cg_escape``): a leading ``_`` was added, drop it. systemd prefixes
    ``_`` to names that could clash with kernel files (``cpu.service`` becomes ``_cpu.service``) and to names
    that start with ``_`` themselves, so one leading ``_`` always goes. ``\\x2d``-style escapes are part of
    the unit name and stay."""
    return component[1:] if component.startswith("_") else component


def _split(path: str) -> list[str]:
    return [unescape_component(part) for part in path.split("/") if part]


def _innermost(components: list[str], suffix: str, start: int) -> int | None:
    """Index of the deepest component at or after ``start`` named ``*suffix``."""
    for index in range(len(components) - 1, start - 1, -1):
        component = components[index]
        if component.endswith(suffix) and len(component) > len(suffix):
            return index
    return None


def _placement(path: str, components: list[str], start: int, uid: int | None) -> CgroupPlacement:
    """The owner of ``path`` below one manager (from ``components[start]`` on): the deepest service
    wins over any scope."""
    unit = _innermost(components, ".service", start)
    if unit is not None:
        return CgroupPlacement(path, components[unit], None, uid, _prefix(path, unit))
    scope = _innermost(components, ".scope", start)
    return CgroupPlacement(path, None, None if scope is None else components[scope], uid)


def _prefix(path: str, index: int) -> str:
    """The raw (escaped) cgroup path up to and including component ``index``."""
    return "/" + "/".join([part for part in path.split("/") if part][: index + 1])


def placement_of_path(path: str) -> CgroupPlacement:
    """Map a cgroup path to the unit that owns it (see the module docstring for the rules)."""
    components = _split(path)
    for index in range(len(components) - 1, -1, -1):
        match = _USER_MANAGER.fullmatch(components[index])
        if match is None:
            continue
        below = components[index + 1 :]
        if not below or below == ["init.scope"]:
            # the user manager's own processes: part of the system unit user@UID.service
            return CgroupPlacement(path, components[index], None, None, _prefix(path, index))
        return _placement(path, components, index + 1, int(match.group(1)))
    return _placement(path, components, 0, None)


def placement_of_proc_cgroup(text: str) -> CgroupPlacement:
    """``/proc/PID/cgroup`` text to a placement; a file naming no cgroup maps like the root."""
    return placement_of_path(parse_proc_cgroup(text) or "/")


def valid_unit_name(name: str) -> bool:
    """Pure: whether ``name`` is one systemd unit name (``foo.service``, ``foo@1.service``), as systemd
    itself would accept it, and nothing systemctl could read as a glob pattern or an option."""
    return len(name) <= UNIT_NAME_MAX and _UNIT_NAME.fullmatch(name) is not None
