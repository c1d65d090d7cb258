"""``--detach`` hands the run to a transient systemd unit; ``--status --wait`` follows a run to its end.

The unit runs the whole run, preflight included, under the lock; secrets reach it through a private
file, never a command line. How and why: docs/detach.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env.environment import Environment
from safeinstall.errors import Aborted, ExitCode, SafeInstallError, SystemdError, UsageError, one_line
from safeinstall.run.parts.options import Mode, RunOptions
from safeinstall.store.history import HistoryEntry, read_history
from safeinstall.store.history import find as find_entry
from safeinstall.store.journal import Journal, JournalError, Phase, read_journal
from safeinstall.store.state import EnvironmentState, atomic_write, is_run_id
from safeinstall.system import children
from safeinstall.system.fields import field, text, texts, typed
from safeinstall.system.identity import ProcessId, alive
from safeinstall.system.lock import read_holder
from safeinstall.system.safefs import UntrustedFile, only_caller_writes, read_trusted
from safeinstall.system.systemd import Systemd

UNIT_PREFIX = "safeinstall-"
#: A ``--prepare``'s result (its history entry stays until its commit's replaces it)
PREPARED_STATUS = "prepared"
#: a refused ``--commit``'s history entry: nothing stopped, the run stays prepared (docs/json.md)
COMMIT_REFUSED = "commit-refused"
#: the history entries of a prepared run that are not a commit's result: its prepare's, a refused commit's
NOT_COMMITTED = (PREPARED_STATUS, COMMIT_REFUSED)
#: How long a commit's result may follow its journal's removal (its tidy-up, then the entry: moments)
COMMIT_RESULT_GRACE_S = 10.0
#: The most an environment file may hold (it is the caller's environment, a few KiB).
_MAX_ENVIRON_BYTES = 1024 * 1024
#: A detached run gets SIGTERM (and rolls back) when its unit is stopped; SIGKILL only this much later.
STOP_TIMEOUT = "15min"


class RunLost(SafeInstallError):
    """The run's process is gone and it left no result: it died (SIGKILL, OOM, power loss)."""

    exit_code = ExitCode.ROLLBACK_FAILED
    code = "run-lost"


def unit_name(state: EnvironmentState, run_id: str) -> str:
    """Pure: the transient unit of a detached run, named after the environment and the run."""
    return f"{UNIT_PREFIX}{state.key}-{run_id}.service"


def child_arguments(options: RunOptions, python: Path, run_id: str, environ_file: Path) -> list[str]:
    """Pure: the arguments that, with the private file :func:`write_private` wrote, make the detached
    safeinstall run exactly ``options`` (``--opt=value`` forms, so that no value is ever taken for an
    option). What may hold a credential (the health URL, uv's arguments) is only in the file."""
    if options.commit:  # the prepared run's own options are in its record: only the window's here
        return commit_arguments(options, python, environ_file)
    undo = [] if options.undo is None else [Mode.UNDO, f"--run={options.undo}"]  # the package: a guard
    args = [options.package + (options.version_spec or ""), *undo, f"--python={python}", "--yes"]
    args += [f"--run-id={run_id}", f"--environ-from={environ_file}"]
    flags = {
        "--user": options.user,
        "--with-deps": options.with_deps,
        "--kill-strays": options.kill_strays,
        "--only-loaded": options.only_loaded,
        "--strict": options.strict,
        "--keep-patches": options.keep_patches,
        "--drop-conflicting": options.drop_conflicting,
        "--accept-record-mismatch": options.accept_record_mismatch,
        "--allow-broken-requirements": options.allow_broken_requirements,
        "--no-restart": options.no_restart,
        "--prune": options.prune,
        "--no-swap": options.no_swap,
        "--full": options.full,
        "--no-smoke": options.no_smoke,
    }
    args += [flag for flag, on in flags.items() if on]
    if options.wheel is not None:
        args.append(f"--wheel={options.wheel}")
    if options.stop_timeout is not None:
        args.append(f"--stop-timeout={options.stop_timeout!r}")
    if options.base_wheel is not None:
        args.append(f"--base-wheel={options.base_wheel}")
    if options.smoke is not None:
        args.append(f"--smoke={options.smoke}")
    args += [f"--smoke-skip={module}" for module in options.smoke_skip]
    args += [
        f"--gpu-timeout={options.gpu_timeout!r}",
        f"--settle={options.settle!r}",
        f"--health-timeout={options.health_timeout!r}",
        f"--keep-backups={options.keep_backups}",
    ]
    if not options.no_smoke:  # with --no-smoke it would be a usage error: there is no check to time
        args.append(f"--smoke-timeout={options.smoke_timeout!r}")
    return args


def commit_arguments(options: RunOptions, python: Path, environ_file: Path) -> list[str]:
    """Pure: a detached ``--commit`` of the environment's prepared run (docs/prepare.md): the window's
    options only; the run id is the prepared run's."""
    args = [Mode.COMMIT, f"--python={python}", "--yes", f"--environ-from={environ_file}"]
    args += ["--user"] if options.user else []
    if options.stop_timeout is not None:
        args.append(f"--stop-timeout={options.stop_timeout!r}")
    return [
        *args,
        f"--gpu-timeout={options.gpu_timeout!r}",
        f"--settle={options.settle!r}",
        f"--health-timeout={options.health_timeout!r}",
        f"--prepared-max-age={options.prepared_max_age!r}",
    ]


def committing(journal: Journal | None, entry: HistoryEntry | None) -> bool:
    """Pure: a prepared run not yet taken by its commit (its journal still ``prepared``), or its
    prepare's entry (or an earlier commit's refusal) while the commit goes on: the commit's own result
    is still to come."""
    if entry is not None and entry.result.status not in NOT_COMMITTED:
        return False
    return journal is None or journal.phase == Phase.PREPARED


def systemd_run_command(unit: str, user: bool, description: str, cwd: str, command: list[str]) -> list[str]:
    """Pure: ``systemd-run`` for a detached run. ``KillMode=mixed``: stopping the unit sends SIGTERM to
    safeinstall alone (it rolls back and ends its children itself)."""
    return [
        "systemd-run",
        "--user" if user else "--system",
        f"--unit={unit}",
        f"--description={description}",
        "--collect",
        "--quiet",
        "--no-ask-password",
        "--service-type=exec",
        f"--working-directory={cwd}",
        "--property=KillMode=mixed",
        f"--property=TimeoutStopSec={STOP_TIMEOUT}",
        "--",
        *command,
    ]


@dataclass(frozen=True, slots=True)
class PrivateInputs:
    """What a detached run gets through its private file, not its command line."""

    environ: dict[str, str]
    health_url: str | None = None
    extra_args: tuple[str, ...] = ()


def write_private(state: EnvironmentState, run_id: str, inputs: PrivateInputs) -> Path:
    path = state.dir / f"environ-{run_id}.json"
    document = {"environ": inputs.environ, "health_url": inputs.health_url, "extra_args": inputs.extra_args}
    atomic_write(path, json.dumps(document).encode("utf-8", "surrogateescape"))
    return path


def take_private(path: Path) -> PrivateInputs:
    """What a detached run was given; the file must be ours, private and regular. Removed."""
    bad = UsageError(f"--environ-from {path}: not an environment file written by safeinstall --detach")
    try:
        if not only_caller_writes(os.stat(path.parent)):  # a directory only we can change
            raise bad
        raw = read_trusted(path, _MAX_ENVIRON_BYTES, root_owned_ok=False, private=True)
    except UntrustedFile as exc:
        raise bad from exc
    except OSError as exc:
        raise UsageError(f"--environ-from {path}: {exc.strerror or exc}") from exc
    path.unlink(missing_ok=True)
    try:  # a FieldError, as JSON's own errors, is a ValueError
        document = typed(json.loads(raw.decode("utf-8", "surrogateescape")), dict)
        environ = {
            text(k, "environ"): text(v, "environ") for k, v in field(document, "environ", dict).items()
        }
        url = field(document, "health_url", str, optional=True)
        inputs = PrivateInputs(environ, url, texts(document.get("extra_args"), "extra_args"))
    except ValueError as exc:
        raise bad from exc
    return inputs


@dataclass(frozen=True, slots=True)
class Detached:
    run_id: str
    unit: str
    user_manager: bool
    log_file: str
    finished: HistoryEntry | None  # the history entry, when the run ended before it journalled


def detach(options: RunOptions, env: Environment, state: EnvironmentState, run_id: str) -> Detached:
    """Start the run as a transient unit; return once it has journalled (or has already ended)."""
    environ_file = write_private(
        state, run_id, PrivateInputs(dict(options.environ), options.health_url, options.extra_args)
    )
    unit = unit_name(state, run_id)
    command = [
        sys.executable,
        "-I",
        "-m",
        "safeinstall",
        *child_arguments(options, env.python, run_id, environ_file),
    ]
    description = f"safeinstall {options.package} in {env.prefix} (run {run_id})"
    argv = systemd_run_command(unit, options.user, description, os.getcwd(), command)
    try:
        proc = children.run(argv, env=options.environ, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        environ_file.unlink(missing_ok=True)
        raise SystemdError(f"systemd-run could not start the detached run: {exc}") from exc
    if proc.returncode != 0:
        environ_file.unlink(missing_ok=True)
        detail = (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"
        raise SystemdError(
            f"systemd-run could not start the detached run: {detail}",
            hint="nothing was changed; run without --detach, or check that the "
            + ("user manager runs (XDG_RUNTIME_DIR)" if options.user else "system manager runs"),
        )
    finished = _await_start(
        state, run_id, Systemd(user=options.user, environ=options.environ), unit, options.commit
    )
    environ_file.unlink(missing_ok=True)  # the run took it; or it never will
    return Detached(run_id, unit, options.user, str(state.log_file(run_id)), finished)


def _own_journal(state: EnvironmentState, run_id: str) -> Journal | None:
    try:
        journal = read_journal(state.dir)
    except JournalError:  # being replaced, or damaged: the run itself will say
        return None
    return journal if journal is not None and journal.run_id == run_id else None


def _await_start(
    state: EnvironmentState,
    run_id: str,
    systemd: Systemd,
    unit: str,
    commit: bool = False,
    poll_s: float = 0.1,
) -> HistoryEntry | None:
    """Wait until the detached run has journalled (None) or has ended (its history entry); a commit:
    until its journal is past ``prepared`` (it passed its checks) or it has its own result."""
    while True:
        entry = find_entry(state, run_id)
        journal = _own_journal(state, run_id)
        if commit and committing(journal, entry):
            entry = journal = None
            if systemd.info(unit).active_state in ("active", "activating", "reloading"):
                time.sleep(poll_s)
                continue
        if commit and journal is not None and entry is not None and entry.result.status in NOT_COMMITTED:
            entry = None  # the prepare's entry, or an earlier commit's refusal: this one journalled past it
        if entry is not None:
            return entry
        if journal is not None:
            return None
        info = systemd.info(unit)
        if info.active_state not in ("active", "activating", "reloading"):
            entry = find_entry(state, run_id)  # it writes its result before it exits
            if entry is not None or _own_journal(state, run_id) is not None:
                return entry
            flag = "--user " if systemd.user else ""
            raise Aborted(
                f"the detached run {run_id} ended before it started (unit {unit}: {info.active_state})",
                hint=f"nothing was changed; see journalctl {flag}-u {unit}",
            )
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------- waiting


def locate(environ_states: list[EnvironmentState], run_id: str | None) -> EnvironmentState:
    """The environment to wait in: the one that knows ``run_id``; else the one with a run in progress;
    else the one whose last run finished last."""
    if run_id is not None:
        for state in environ_states:
            journal = _own_journal(state, run_id)
            if journal is not None or (state.history / f"{run_id}.json").exists():
                return state
            if state.log_file(run_id).exists():
                return state
        raise UsageError(
            f"no run {one_line(run_id)} is known here", hint="safeinstall --status lists the runs"
        )
    running = [s for s in environ_states if s.journal.exists()]
    if len(running) > 1:
        raise UsageError(
            "runs are in progress in several environments: "
            + ", ".join(str(s.prefix or s.dir) for s in running),
            hint="name one with --python PY or --run RUN_ID",
        )
    if running:
        return running[0]
    latest = [(h.runs[0].finished_at or "", s) for s in environ_states if (h := read_history(s)).runs]
    if not latest:
        raise UsageError(
            "no run to wait for: none is in progress and none has finished",
            hint="start one (safeinstall PACKAGE --wheel W --detach), then wait for it",
        )
    return max(latest, key=lambda pair: pair[0])[1]


def wait_for_run(
    state: EnvironmentState, run_id: str | None, on_line: Callable[[str], None], poll_s: float = 0.2
) -> HistoryEntry:
    """Follow a run to its end, passing each new line of its log to ``on_line``; its history entry.
    ``run_id`` None: the run in progress, else the last finished one. Raises :class:`RunLost` when the
    run's process is gone without a result (a journal left: it needs ``--recover``)."""
    from safeinstall.store.runlog import LogTail

    if run_id is not None and not is_run_id(run_id):
        raise UsageError(f"{run_id!r} is not a run id", hint="run ids look like 20261130T031201Z-1234")
    watched: ProcessId | None = None
    tail: LogTail | None = None
    committed_since: float | None = None  # a commit of the run was last seen going on (monotonic s)
    while True:
        journal = read_journal(state.dir)
        if run_id is None:
            if journal is not None:
                run_id = journal.run_id
            elif read_holder(state.lock)[0]:  # a run in its preflight: its id comes with its journal
                time.sleep(poll_s)
                continue
            else:
                runs = read_history(state).runs
                if not runs:
                    raise UsageError(
                        f"no run to wait for in {state.prefix or state.dir}",
                        hint="safeinstall --status lists the runs",
                    )
                run_id = runs[0].run_id
        if tail is None:
            tail = LogTail(state.log_file(run_id))
        for line in tail.new_lines():
            on_line(line)
        entry = find_entry(state, run_id)
        if entry is not None and entry.result.status in NOT_COMMITTED:
            # the prepare's result (or a refused commit's): while a commit goes on (its journal past
            # ``prepared``, or gone for the moment between the commit's tidy-up and its result), not
            # the one waited for
            if journal is not None and journal.run_id == run_id and journal.phase != Phase.PREPARED:
                committed_since = time.monotonic()
                entry = None
            elif journal is None and committed_since is not None:
                entry = None if time.monotonic() - committed_since < COMMIT_RESULT_GRACE_S else entry
        if entry is not None:
            for line in tail.new_lines():
                on_line(line)
            return entry
        if journal is not None and journal.run_id == run_id:
            watched = journal.process
        elif watched is None:
            held, holder = read_holder(state.lock)
            if not (held and holder is not None):
                raise UsageError(
                    f"the run {run_id} is neither running nor finished in {state.prefix or state.dir}",
                    hint="safeinstall --status lists the runs",
                )
            watched = holder.process  # a run in its preflight: maybe this one
        if not alive(watched):
            if find_entry(state, run_id) is not None:
                continue
            left = _own_journal(state, run_id)
            if left is not None:
                raise RunLost(
                    f"the run {run_id} died in phase {left.phase} without finishing (PID {left.pid} is gone)",
                    hint="run safeinstall --recover to put its changes back or finish them",
                )
            raise UsageError(
                f"the run {run_id} is neither running nor finished in {state.prefix or state.dir}",
                hint="safeinstall --status lists the runs",
            )
        time.sleep(poll_s)
