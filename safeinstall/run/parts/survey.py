"""Survey the host for a plan: ask uv, scan /proc, ask systemd, ask NVML; then :func:`build_plan`.

Only gathering happens here; every decision is in :mod:`safeinstall.scan.plan`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from safeinstall.env.dependents import marker_environment, weigh_dependents
from safeinstall.env.distributions import InstalledDistribution, find_distribution, find_distributions
from safeinstall.env.environment import (
    Environment,
    inspect_environment,
    interpreter_in_prefix,
    resolve_python,
)
from safeinstall.env.systemsite import check_target
from safeinstall.env.uvplan import UvPlan, UvRequest, dry_run, link_mode_for, same_filesystem
from safeinstall.env.wheel import Wheel, read_wheel
from safeinstall.errors import SystemdError
from safeinstall.run.parts.options import RunOptions
from safeinstall.scan.evidence import TargetIndex
from safeinstall.scan.plan import Plan, build_plan, start_limit_resets
from safeinstall.scan.processes import ScanResult, scan_processes
from safeinstall.scan.targets import (
    EnvironmentScope,
    Target,
    directory_owners,
    environment_scope,
    load_targets,
)
from safeinstall.store.state import state_root
from safeinstall.system.cgroups import placement_of_proc_cgroup, valid_unit_name
from safeinstall.system.gpus import GpuSnapshot, snapshot_gpus
from safeinstall.system.systemd import Systemd, UnitInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Survey:
    env: Environment
    installed: tuple[InstalledDistribution, ...]
    target: InstalledDistribution
    wheel: Wheel | None
    request: UvRequest
    uv_plan: UvPlan
    affected: tuple[InstalledDistribution, ...]  # installed distributions the install replaces
    targets: tuple[Target, ...]  # the affected distributions as the /proc scan recognises them
    #: the distributions of the environment that require an affected one (``depends`` evidence)
    dependent_targets: tuple[Target, ...]
    scope: EnvironmentScope  # the environment itself (``environment`` evidence)
    #: ``targets`` and ``dependent_targets`` as the scan looks them up: built once, before the stop
    #: (vLLM's 29k files: 0.5 s, which the second scan in the window no longer pays)
    index: TargetIndex
    scan: ScanResult
    units: dict[str, UnitInfo]
    gpus: GpuSnapshot
    plan: Plan


def systemd_for(options: RunOptions) -> Systemd:
    return Systemd(user=options.user, environ=options.environ)


def _dependent(name: str) -> bool:
    return name.endswith(".service") and valid_unit_name(name)


def _gate_refusals(systemd: Systemd) -> tuple[str, ...]:
    """The plan's refusal when the manager reads no admin directory, where the gate's drop-in goes (a
    manager started with ``SYSTEMD_UNIT_PATH``): said before anything, not at the gate."""
    try:
        systemd.dropin_roots()
    except SystemdError as exc:
        return (f"{exc.message} ({exc.advice})",)
    return ()


def survey(
    options: RunOptions,
    env: Environment | None = None,
    wheel: Wheel | None = None,
    swap: UvPlan | None = None,
    *,
    reading: Callable[[], Wheel] | None = None,
) -> Survey:
    """Gather every fact the plan needs; changes nothing. ``swap``: an undo's plan (uv is not asked);
    ``wheel`` or ``reading``: the wheel, or a wait for its reading thread, called once uv has planned so
    that the ``/proc`` scan may fork."""
    if env is None:
        env = inspect_environment(resolve_python(options.python, options.environ))
    installed = tuple(find_distributions(env))
    target = find_distribution(env, options.package, list(installed))
    # dpkg's, the base's, PEP 668: before uv is asked
    check_target(env, target, options.extra_args, options.environ)
    if wheel is None and reading is None and options.wheel is not None:
        wheel = read_wheel(options.wheel)
    request = UvRequest(
        python=interpreter_in_prefix(env),  # the checked path, not one through a link others may change
        package=target.name,
        wheel=options.wheel,
        version_spec=options.version_spec,
        installed_version=target.version,
        with_deps=options.with_deps,
        extra_args=options.extra_args,
        link_mode=link_mode_for(
            options.extra_args, same_filesystem(state_root(options.environ, os.geteuid()), env.prefix)
        ),
    )
    # as the owner (uv runs its .pth files); uv's lock file, if this made one, goes again
    uv_plan = swap or dry_run(request, options.environ, account=env.account, prefix=env.prefix)
    if reading is not None:
        wheel = reading()
    by_name = {d.name: d for d in installed}
    affected = tuple(by_name[n] for n in sorted({*uv_plan.affected, target.name}) if n in by_name)
    owners = directory_owners(installed)
    targets = load_targets(affected, env, installed, owners=owners)
    found = weigh_dependents(installed, [d.name for d in affected], marker_environment(env))
    chains = found.chains
    dependent_targets = load_targets([by_name[n] for n in chains], env, installed, chains, owners)
    scope = environment_scope(env)
    index = TargetIndex.of((*targets, *dependent_targets))
    scan = scan_processes(index, options.proc_root, scope=scope)
    unit_names = {
        placement.unit
        for record in scan.processes
        if record.affected and not record.is_self
        for placement in [placement_of_proc_cgroup(record.cgroup_text)]
        if placement.unit and valid_unit_name(placement.unit)  # the plan refuses the others
    }
    systemd = systemd_for(options)
    units: dict[str, UnitInfo] = {}
    wanted = unit_names
    while wanted:  # these units, then those a stop of them stops too, transitively (see plan._dependents)
        more = systemd.show(sorted(wanted))
        units.update(more)
        wanted = {d for info in more.values() for d in info.dependents if _dependent(d)} - set(units)
    gpus = snapshot_gpus(options.environ, options.proc_root)
    plan = build_plan(
        package=target.name,
        python=str(env.python),
        prefix=str(env.prefix),
        user=options.user,
        with_deps=options.with_deps,
        kill_strays=options.kill_strays,
        only_loaded=options.only_loaded,
        uv_plan=uv_plan,
        installed_versions={d.name: d.version for d in installed},
        wheel_version=wheel.version if wheel else None,
        scan=scan,
        units=units,
        gpus=gpus,
        as_root=os.geteuid() == 0,
    )
    if plan.units:  # the units whose restart their start limit could refuse (needrestart#340)
        # a name no systemctl may be given (globs from a cgroup) is refused by the plan, never asked about
        limits = systemd.start_limits(u.name for u in plan.units if valid_unit_name(u.name))
        plan = replace(plan, start_limit_resets=start_limit_resets(limits, time.monotonic()))
        plan = replace(plan, refusals=(*plan.refusals, *_gate_refusals(systemd)))
    if env.owner_note:  # said in the plan too: a dry run shows whose environment this is
        plan = replace(plan, warnings=(env.owner_note, *plan.warnings))
    if uv_plan.lock_note:  # who held uv's lock while the plan's uv waited for it (issue 35)
        plan = replace(plan, warnings=(*plan.warnings, uv_plan.lock_note))
    if (unweighed := found.note()) is not None:  # the owner's METADATA past the bound (the attacker review)
        plan = replace(plan, warnings=(*plan.warnings, unweighed))
    return Survey(
        env=env,
        installed=installed,
        target=target,
        wheel=wheel,
        request=request,
        uv_plan=uv_plan,
        affected=affected,
        targets=targets,
        dependent_targets=dependent_targets,
        scope=scope,
        index=index,
        scan=scan,
        units=units,
        gpus=gpus,
        plan=plan,
    )


def scan_again(found: Survey, options: RunOptions) -> ScanResult:
    """The same scan as the plan's (every kind of evidence), now: who uses the package at this moment."""
    return scan_processes(found.index, options.proc_root, scope=found.scope)
