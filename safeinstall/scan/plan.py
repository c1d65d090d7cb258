"""The plan: which distributions change, which processes use them, which units stop. Pure.

:func:`build_plan` joins facts gathered elsewhere (uv's dry-run, the /proc scan, ``systemctl show``,
an NVML snapshot) into one :class:`Plan`, and says whether the run would proceed or refuse, and why."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from packaging.version import Version

from safeinstall.env.containment import is_below
from safeinstall.env.uvplan import UvPlan
from safeinstall.scan.evidence import Evidence, EvidenceKind, Strength
from safeinstall.scan.processes import TOO_LARGE, ProcessRecord, ScanProblem, ScanResult
from safeinstall.system.cgroups import CgroupPlacement, placement_of_proc_cgroup, valid_unit_name
from safeinstall.system.gpus import GpuSnapshot
from safeinstall.system.identity import ProcessId
from safeinstall.system.systemd import StartLimit, UnitInfo, start_limit_risk


@dataclass(frozen=True, slots=True)
class AffectedDistribution:
    name: str
    old_version: str | None  # None: not installed now
    new_version: str | None  # None: uv did not say (a wheel path or URL without a version)
    requested: bool  # the package named on the command line

    @property
    def change(self) -> str:
        """Pure: "upgrade", "downgrade", "same version" (a clean reinstall), or "" when either version
        is unknown or not a PEP 440 version."""
        if self.old_version is None or self.new_version is None:
            return ""
        try:
            old, new = Version(self.old_version), Version(self.new_version)
        except ValueError:  # InvalidVersion, or over 4,300 digits (int() refuses): the owner's METADATA
            return ""
        return "upgrade" if new > old else "downgrade" if new < old else "same version"


@dataclass(frozen=True, slots=True)
class PlannedProcess:
    process: ProcessId  # in --json, flat: ``pid`` and ``start_time`` (docs/json.md)
    user: str
    name: str
    cmdline: tuple[str, ...]
    unit: str | None
    scope: str | None
    evidence: tuple[str, ...]  # evidence kinds: mapped, open, argv, depends, environment, unit
    details: tuple[str, ...]  # one line per piece of evidence
    distributions: tuple[str, ...]
    running_old_code: bool  # maps a deleted file of an affected distribution
    gpu_bytes: int | None  # GPU memory NVML lists for it (None: none listed or N/A)
    #: "certain": it runs the package's code (or shares a unit with such a process); "possible": it
    #: (or the affected processes of its unit) only runs the environment's Python (``environment``)
    strength: str = Strength.CERTAIN.value
    #: its strongest evidence in a few words, for the plan at a glance ("maps torch/lib/x.so")
    reason: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(frozen=True, slots=True)
class PlannedUnit:
    name: str
    active_state: str
    unit_file_state: str
    main_pid: int | None
    stop_timeout_s: float
    control_group: str | None
    pids: tuple[int, ...]  # affected processes in it
    #: why it stops although no affected process runs in it: "stopped with vllm.service" (its
    #: Requires=, BindsTo= or PartOf= names a unit that stops); "" for a unit of affected processes
    stopped_with: str = ""


@dataclass(frozen=True, slots=True)
class StartLimitReset:
    """A unit whose start limit the run's restart could hit: ``systemctl reset-failed`` before the stop
    (and again before a rollback's start), so that the restart is not refused (needrestart#340)."""

    unit: str
    reason: str


def start_limit_resets(limits: Mapping[str, StartLimit], now_s: float) -> tuple[StartLimitReset, ...]:
    """Pure: the units (of ``limits``, each planned unit's start limit) that the run resets, and why."""
    return tuple(
        StartLimitReset(unit, reason)
        for unit, limit in sorted(limits.items())
        if (reason := start_limit_risk(limit, now_s)) is not None
    )


@dataclass(frozen=True, slots=True)
class KeptBackupHeld:
    """One kept backup of the environment (``--keep-backups``) and the bytes its files hold."""

    run_id: str
    path: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    package: str
    python: str
    prefix: str
    user_manager: bool
    with_deps: bool
    kill_strays: bool
    distributions: tuple[AffectedDistribution, ...]
    processes: tuple[PlannedProcess, ...]  # every affected process, strays included
    units: tuple[PlannedUnit, ...]
    strays: tuple[PlannedProcess, ...]
    gpus: GpuSnapshot
    uv_command: tuple[str, ...]
    scan_problems: tuple[ScanProblem, ...]
    refusals: tuple[str, ...]
    warnings: tuple[str, ...]
    only_loaded: bool = False  # --only-loaded: processes with only possible evidence are left out
    #: PIDs of the processes --only-loaded leaves out (only ``environment`` evidence); they keep running
    left_out: tuple[int, ...] = ()
    #: installed files of the affected distributions that differ from their RECORD (local patches,
    #: deletions): the reinstall replaces them (kept in the backup; --keep-patches carries them)
    locally_modified: tuple[str, ...] = ()
    #: what will run to install, as the preflight found it
    #: (:func:`safeinstall.run.parts.staging.install_lines`): the staging install and the swap, or the install
    #: in the stop, or an undo's restore
    install: tuple[str, ...] = ()
    #: those of ``warnings`` about the host, not this run (processes even root cannot read, no NVML): the
    #: same on every command of that machine, so ``-q`` leaves them out (``--json`` and the log keep them)
    host_notes: tuple[str, ...] = ()
    #: units whose start limit the restart could hit: reset before the stop (systemctl reset-failed)
    start_limit_resets: tuple[StartLimitReset, ...] = ()
    #: what the run runs before the stop to exercise the new version (safeinstall.env.importcheck); "":
    #: nothing
    smoke: str = ""
    #: the environment's kept backups, oldest first (their room: a refusal for it names which to drop)
    kept_backups: tuple[KeptBackupHeld, ...] = ()

    @property
    def proceeds(self) -> bool:
        return not self.refusals


@dataclass(frozen=True, slots=True)
class OldCodeProcess:
    """A process that still maps a replaced (deleted) file of an affected distribution."""

    pid: int
    name: str
    cmdline: tuple[str, ...]
    unit: str | None
    scope: str | None
    distributions: tuple[str, ...]
    paths: tuple[str, ...]  # the replaced files it maps

    def describe(self) -> str:
        where = f"unit {self.unit}" if self.unit else f"no unit ({self.scope or 'no scope'})"
        names = ", ".join(self.distributions)
        return f"PID {self.pid} ({self.name}, {where}) still maps replaced files of {names}"


def left_on_old_code(scan: ScanResult) -> tuple[OldCodeProcess, ...]:
    """The processes of ``scan`` (of the affected distributions' targets) that run replaced code."""
    found: list[OldCodeProcess] = []
    for record in scan.processes:
        if record.is_self or record.state == "Z" or not record.running_old_code:
            continue
        old = [e for e in record.evidence if e.deleted]
        placement = placement_of_proc_cgroup(record.cgroup_text)
        found.append(
            OldCodeProcess(
                pid=record.pid,
                name=record.name,
                cmdline=record.cmdline,
                unit=placement.unit,
                scope=placement.scope,
                distributions=tuple(sorted({e.distribution for e in old})),
                paths=tuple(dict.fromkeys(e.path for e in old)),
            )
        )
    return tuple(found)


def affected_distributions(
    uv_plan: UvPlan, installed: Mapping[str, str], package: str, wheel_version: str | None
) -> tuple[AffectedDistribution, ...]:
    """Every distribution uv would uninstall or install, with old and new versions."""
    names = set(uv_plan.affected) | {package}
    result: list[AffectedDistribution] = []
    for name in sorted(names):
        new_versions = [c.version for c in uv_plan.changes if c.name == name and c.action != "uninstall"]
        new = next((v for v in new_versions if v), None)
        if new is None and name == package:
            new = wheel_version
        result.append(AffectedDistribution(name, installed.get(name), new, name == package))
    return tuple(result)


def persistence_warnings(gpus: GpuSnapshot, planned: Collection[int]) -> list[str]:
    """Pure: a warning for each GPU that a planned process uses and whose NVML persistence mode is off:
    the driver then tears the GPU's state down when its last process exits, and each start pays its
    initialisation again (1-3 s per GPU)."""
    return [
        f"GPU {gpu.index} ({gpu.name}) has NVML persistence mode off: the restart pays its initialisation "
        "again (1-3 s per GPU); `nvidia-smi -pm 1` (or the nvidia-persistenced service) keeps it"
        for gpu in gpus.gpus
        if gpu.persistence_mode is False and any(p.pid in planned for p in gpu.processes)
    ]


def _gpu_bytes(gpus: GpuSnapshot) -> dict[int, int]:
    held: dict[int, int] = {}
    for process in gpus.all_processes():
        if process.used_bytes is not None:
            held[process.pid] = held.get(process.pid, 0) + process.used_bytes
    return held


#: Evidence kinds from the strongest (it runs the package's code, old code first) to the weakest.
_STRONGEST_FIRST = (EvidenceKind.MAPPED, EvidenceKind.OPEN, EvidenceKind.ARGV, EvidenceKind.DEPENDS)
_SITE_MARKERS = ("/site-packages/", "/dist-packages/")


def short_path(path: str) -> str:
    """Pure: a path below a site directory as the package sees it (``torch/lib/libtorch_cpu.so``);
    any other path whole."""
    for marker in _SITE_MARKERS:
        head, found, tail = path.rpartition(marker)
        if found and head:
            return tail
    return path


def strongest_reason(evidence: Sequence[Evidence], unit: str | None, shares_unit: bool) -> str:
    """Pure: one reason, from the strongest piece of evidence: "maps torch/lib/libtorch_cpu.so (deleted:
    old code)", "runs vllm", "maps xgrammar 0.2.8, which requires torch", "shares vllm.service with an
    affected process", or what makes it the environment's."""
    ranked = sorted(
        (e for e in evidence if e.kind in _STRONGEST_FIRST),
        key=lambda e: (not e.deleted, _STRONGEST_FIRST.index(e.kind)),
    )
    if ranked:
        best = ranked[0]
        old = " (deleted: old code)" if best.deleted else ""
        if best.kind is EvidenceKind.DEPENDS:
            return best.detail or f"depends on {best.distribution}"
        verb = {EvidenceKind.MAPPED: "maps", EvidenceKind.OPEN: "holds open"}.get(best.kind, "runs")
        return f"{verb} {short_path(best.path)}{old}"
    if shares_unit:
        return f"shares {unit} with an affected process"
    environment = next((e for e in evidence if e.kind is EvidenceKind.ENVIRONMENT), None)
    return environment.detail if environment is not None else ""


def _planned(
    record: ProcessRecord,
    placement: CgroupPlacement,
    extra_evidence: Iterable[str],
    held: Mapping[int, int],
    strength: Strength | None,
) -> PlannedProcess:
    kinds = [e.kind.value for e in record.evidence]
    details = [e.describe() for e in record.evidence]
    for kind in extra_evidence:
        kinds.append(kind)
        details.append(f"shares {placement.unit} with an affected process")
    reason = strongest_reason(record.evidence, placement.unit, len(kinds) > len(record.evidence))
    return PlannedProcess(
        process=record.process,
        user=record.user,
        name=record.name,
        cmdline=record.cmdline,
        unit=placement.unit,
        scope=placement.scope,
        evidence=tuple(dict.fromkeys(kinds)),
        details=tuple(details),
        distributions=tuple(sorted(record.distributions)),
        running_old_code=record.running_old_code,
        gpu_bytes=held.get(record.pid),
        strength=(strength or record.strength or Strength.CERTAIN).value,
        reason=reason,
    )


def _unit_refusal(unit: str, info: UnitInfo | None, user: bool, placement: CgroupPlacement) -> str | None:
    manager = "user" if user else "system"
    if not valid_unit_name(unit):
        return (
            f"the cgroup {placement.path} names {unit!r}, which is not a valid systemd unit name: it is "
            "never passed to systemctl (it could match other units there) nor gated; stop its processes "
            "yourself"
        )
    if placement.user_manager_uid is not None and not user:
        return (
            f"{unit} belongs to the user manager of UID {placement.user_manager_uid}: "
            "run as that user with --user"
        )
    if info is None or not info.found:
        other = "without --user" if user else "with --user"
        return f"{unit} is not known to the {manager} manager: try {other}"
    if not info.control_group:  # a unit with processes has a cgroup: a process is never in one without
        return (
            f"{unit} of the {manager} manager is not running (it has no cgroup), yet a process sits in "
            f"{placement.path}: the process belongs to another manager"
        )
    if placement.path != info.control_group and not is_below(placement.path, info.control_group):
        return (
            f"{unit} of the {manager} manager runs in {info.control_group}, not in {placement.path}: "
            "the process belongs to another manager"
        )
    return None


def _planned_unit(
    name: str, info: UnitInfo | None, pids: tuple[int, ...], stopped_with: str = ""
) -> PlannedUnit:
    return PlannedUnit(
        name=name,
        active_state=info.active_state if info else "unknown",
        unit_file_state=info.unit_file_state if info else "unknown",
        main_pid=info.main_pid if info else None,
        stop_timeout_s=info.timeout_stop_s if info else 0.0,
        control_group=info.control_group if info else None,
        pids=pids,
        stopped_with=stopped_with,
    )


def _dependents(planned: list[PlannedUnit], units: Mapping[str, UnitInfo]) -> list[PlannedUnit]:
    """Active services that stopping the planned units stops too (their Requires=, BindsTo= or PartOf=
    names one), transitively: a start of those units would not bring them back, so they are planned
    (stopped, gated, started again) like the others. Targets and other kinds are left to systemd."""
    names = {unit.name for unit in planned}
    found: list[PlannedUnit] = []
    queue = list(planned)
    while queue:
        unit = queue.pop(0)
        info = units.get(unit.name)
        for name in info.dependents if info else ():
            dependent = units.get(name)
            if (
                name in names
                or not name.endswith(".service")
                or not valid_unit_name(name)
                or dependent is None
                or not dependent.is_active
            ):
                continue
            names.add(name)
            found.append(_planned_unit(name, dependent, (), stopped_with=unit.name))
            queue.append(found[-1])
    return found


def unreadable_warning(problems: Sequence[ScanProblem], as_root: bool) -> str | None:
    """Pure: what could not be read of which processes, and why, for the processes that denied access.

    Only a user who is not root is told to run as root: root that is refused (PID 1 of a VM or a
    container that denies its maps to everyone, a security module) is not lacking a permission."""
    denied: dict[int, list[str]] = {}
    for problem in problems:
        if "permission" in problem.reason.lower():
            denied.setdefault(problem.pid, []).append(problem.reading)
    if not denied:
        return None
    listed = ", ".join(f"PID {pid} ({', '.join(readings)})" for pid, readings in sorted(denied.items())[:10])
    more = f" and {len(denied) - 10} more" if len(denied) > 10 else ""
    text = f"could not read {len(denied)} process(es): {listed}{more}"
    if as_root:  # short: said on every plan of such a host (a container's PID 1)
        return text + ": denied even to root (a container's init, a security policy)"
    return text + ": permission denied; run as root to see every process"


def oversized_warning(problems: Sequence[ScanProblem]) -> str | None:
    """Pure: the processes whose ``maps`` was too large to read: what they map is not known (their
    open files, command line and environment still count)."""
    pids = sorted({p.pid for p in problems if p.reason == TOO_LARGE and p.reading == "maps"})
    if not pids:
        return None
    listed = ", ".join(f"PID {pid}" for pid in pids[:10]) + (
        f" and {len(pids) - 10} more" if len(pids) > 10 else ""
    )
    return (
        f"the memory maps of {listed} are {TOO_LARGE.split(':')[0]}: whether they map the package is "
        "not known (stop them yourself if they use it)"
    )


def stray_refusal(strays: Sequence[PlannedProcess]) -> str:
    """Pure: why the run refuses over processes outside any service, and each way out that would work:
    ``--only-loaded`` is named only for strays it leaves out (only possible evidence: they run the
    environment's Python, no sign of the package loaded), never for one that certainly uses it."""
    listed = ", ".join(f"{p.pid} ({p.name})" for p in strays)
    possible = [p.pid for p in strays if p.strength == Strength.POSSIBLE.value]
    text = (
        f"{len(strays)} process(es) use the package (or run its environment's Python) outside any "
        f"systemd service: {listed}; stop them, or pass --kill-strays to end them (they are not restarted)"
    )
    if not possible:
        return text
    which = "them" if len(possible) == len(strays) else f"PID {', '.join(map(str, possible))}"
    return (
        f"{text}; --only-loaded would leave {which} out (only the environment's Python, no sign of the "
        "package loaded: left running, on the new files once they import it)"
    )


def build_plan(
    *,
    package: str,
    python: str,
    prefix: str,
    user: bool,
    with_deps: bool,
    kill_strays: bool,
    only_loaded: bool = False,
    uv_plan: UvPlan,
    installed_versions: Mapping[str, str],
    wheel_version: str | None,
    scan: ScanResult,
    units: Mapping[str, UnitInfo],
    gpus: GpuSnapshot,
    as_root: bool = False,
) -> Plan:
    placements = {p.pid: placement_of_proc_cgroup(p.cgroup_text) for p in scan.processes}
    live = [p for p in scan.processes if not p.is_self and p.state != "Z"]
    # a process with only possible evidence (``environment``) is planned unless --only-loaded
    planned_alone = [p for p in live if p.certain or (p.affected and not only_loaded)]
    # a unit is its cgroup, not its name: another manager may run a unit of the same name
    affected_units = {placements[p.pid].unit_path for p in planned_alone} - {None}
    # a unit is as certain as the most certain of its affected processes
    certain_units = {placements[p.pid].unit_path for p in live if p.certain} - {None}
    left_out = tuple(
        p.pid
        for p in live
        if only_loaded and p.affected and not p.certain and placements[p.pid].unit_path not in affected_units
    )
    held = _gpu_bytes(gpus)
    processes: list[PlannedProcess] = []
    unit_kind = (EvidenceKind.UNIT.value,)
    for record in live:
        placement = placements[record.pid]
        in_certain_unit = placement.unit_path in certain_units
        strength = Strength.CERTAIN if record.certain or in_certain_unit else Strength.POSSIBLE
        if record.certain:
            processes.append(_planned(record, placement, (), held, strength))
        elif placement.unit_path in affected_units or (record.affected and not only_loaded):
            # its own evidence (if any) is possible: the unit's may say more (the API-server shape)
            extra = unit_kind if in_certain_unit or not record.affected else ()
            processes.append(_planned(record, placement, extra, held, strength))
    strays = tuple(p for p in processes if p.unit is None)
    planned_units: list[PlannedUnit] = []
    refusals: list[str] = []
    for unit_path in sorted(u for u in affected_units if u):
        members = tuple(p.pid for p in processes if placements[p.pid].unit_path == unit_path)
        example = placements[members[0]]
        unit = example.unit or unit_path
        info = units.get(unit)
        refusal = _unit_refusal(unit, info, user, example)
        if refusal:
            refusals.append(refusal)
        planned_units.append(_planned_unit(unit, info, members))
    planned_units.extend(_dependents(planned_units, units))
    if strays and not kill_strays:
        refusals.append(stray_refusal(strays))
    unread = unreadable_warning(scan.problems, as_root)
    no_gpu_check = None if gpus.available else f"GPU check unavailable: {gpus.reason}"
    warnings = [w for w in (oversized_warning(scan.problems), unread, no_gpu_check) if w]
    # root that cannot read a process (a VM's init), a machine without NVML: so on every command
    host = tuple(w for w in (unread if as_root else None, no_gpu_check) if w)
    warnings.extend(persistence_warnings(gpus, {p.pid for p in processes}))
    if left_out:
        warnings.append(
            f"--only-loaded leaves out {len(left_out)} process(es) that run this environment's Python "
            f"without a sign of the package loaded (PIDs {', '.join(map(str, left_out))}): they keep "
            "running, and one that imports it later gets the new files"
        )
    if kill_strays:
        warnings.extend(f"stray PID {p.pid} ({p.name}) will be ended and not restarted" for p in strays)
    return Plan(
        package=package,
        python=python,
        prefix=prefix,
        user_manager=user,
        with_deps=with_deps,
        kill_strays=kill_strays,
        distributions=affected_distributions(uv_plan, installed_versions, package, wheel_version),
        processes=tuple(processes),
        units=tuple(planned_units),
        strays=strays,
        gpus=gpus,
        uv_command=uv_plan.command,
        scan_problems=scan.problems,
        refusals=tuple(refusals),
        warnings=tuple(warnings),
        only_loaded=only_loaded,
        left_out=left_out,
        host_notes=host,
    )
