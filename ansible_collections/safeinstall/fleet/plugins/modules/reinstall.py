#!/usr/bin/python
# Copyright: the safeinstall authors. MIT License (see the repository's pyproject.toml).
"""Ansible module safeinstall.fleet.reinstall: the safe reinstall of one package on one host."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: reinstall
short_description: Reinstall a Python package safely under the systemd services that use it
version_added: "0.1.0"
description:
  - Runs the C(safeinstall) command line on the host with C(--json --yes) and maps its result. safeinstall
    finds the processes and units that use the package, stops them, waits for their GPU memory to be
    released, installs, verifies every installed file and starts the units again; on any failure after
    the stop it puts everything back (rollback).
  - Exit 0 is V(changed=true). Exit 2 fails with C(refused, nothing changed). Exit 3 fails with
    C(rolled back) (the previous installation runs again). Exit 4 fails with the commands that finish the
    job by hand (RV(commands)).
  - In check mode it runs C(--dry-run) and reports changed when the run would stop or install anything.
    A plan that would refuse fails, as the real run would.
  - In diff mode it shows each distribution's old and new version and the units that are restarted.
  - With O(phase), a run is done in two halves, as C(safeinstall --prepare) then C(safeinstall --commit).
    V(prepare) does everything before the stop while the service serves (the checks, the backup, the new
    version staged and imported), on every host at once; V(commit) does only the window and what follows,
    one host (or C(serial) batch) at a time; V(discard) drops a prepared run that is not to be committed.
  - A rolling upgrade prepares every host in parallel, then commits with C(serial) and
    C(max_fail_percentage=0), stopping at the first host whose commit fails, and discards the prepared
    runs left (see the collection's C(examples/rolling-upgrade.yml)).
  - Values are passed to safeinstall as one argument each; nothing goes through a shell.
options:
  name:
    description:
      - The distribution to reinstall, for example V(vllm). Required for O(phase=run) and O(phase=prepare).
      - With O(phase=commit) or O(phase=discard), a guard; the prepared run must be of this package, or
        nothing is done (failed). Without it, the environment's prepared run is taken, whatever its package.
    type: str
  phase:
    description:
      - V(run) reinstalls in one go (prepare and commit in one).
      - V(prepare) runs C(safeinstall --prepare), everything up to and including the smoke check, and
        keeps the run for the commit. Nothing is stopped or changed in place. The result is V(changed=true),
        because a prepared run is now on the host (its backup, staged tree and journal) until committed or
        discarded. It takes the options of the run but not those of the window (O(stop_timeout),
        O(gpu_timeout), O(settle), O(health_url), O(health_timeout)), which go to the commit.
      - V(commit) runs C(safeinstall --commit) on the environment's prepared run. It checks that nothing
        the run depends on changed since the prepare, then the stop, the swap, the restart and the checks
        after. It takes O(python), O(user), the window's options and O(prepared_max_age), nothing that the
        prepare fixed (O(wheel), O(requirement), O(with_deps), and so on). It maps as a run. Exit 0 is
        V(changed=true); 2 fails with C(refused, nothing changed), for example when something changed since
        the prepare, and the prepared run stays (discard it); 3 fails with C(rolled back).
      - V(discard) runs C(safeinstall --discard). Exit 0 is V(changed=true) (RV(status=discarded)). With no
        prepared run there, nothing is run and the result is ok and not changed (RV(status=not-prepared)),
        so a play can discard on every host that may still hold one.
      - A commit or a discard first reads C(safeinstall --status) for the prepared run. In check mode that
        is all they do. They report V(changed=true) when a run is prepared, and the commit fails when none is.
        V(prepare) in check mode runs C(--dry-run), as V(run) does.
    type: str
    choices: [run, prepare, commit, discard]
    default: run
  prepared_max_age:
    description:
      - With O(phase=commit), refuse a prepared run older than this many seconds (C(--prepared-max-age));
        safeinstall's default is 86400 (a day).
    type: float
  wheel:
    description:
      - A wheel file on the host to install (C(--wheel)). Copy it there first (M(ansible.builtin.copy)).
      - Without O(wheel) or O(requirement), the installed version is reinstalled from the configured index
        (a clean reinstall that wipes local patches).
    type: path
  requirement:
    description:
      - A requirement naming the same package, for example V(vllm==0.16.0), installed from the configured
        index. It is passed as safeinstall's positional argument in place of O(name).
      - Point uv at an index with the task's C(environment) (for example C(UV_INDEX_URL)).
    type: str
  python:
    description:
      - The target interpreter or venv directory on the host (C(--python)). Default as safeinstall's
        (C(VIRTUAL_ENV), then C(python3) on C(PATH)).
    type: str
  user:
    description:
      - The units are the user's systemd units (C(--user), as C(systemctl --user)).
    type: bool
    default: false
  with_deps:
    description:
      - Reinstall the dependencies too (C(--with-deps), uv's C(--reinstall)).
    type: bool
    default: false
  stop_timeout:
    description:
      - Seconds to wait for each unit to stop (C(--stop-timeout)); default each unit's C(TimeoutStopSec).
    type: float
  gpu_timeout:
    description:
      - Seconds to wait for the GPU memory to be released (C(--gpu-timeout)); safeinstall's default is 120.
    type: float
  settle:
    description:
      - Seconds a restarted unit must stay active with the same main process (C(--settle)); safeinstall's
        default is 5.
    type: float
  health_url:
    description:
      - After the restart, wait until this URL answers HTTP 200 (C(--health-url)); vLLM serves C(/health).
      - It is passed in the environment variable C(SAFEINSTALL_HEALTH_URL), never on the command line
        (a URL with a token would be readable by every local user).
    type: str
  health_timeout:
    description:
      - Seconds to wait for O(health_url) (C(--health-timeout)); safeinstall's default is 300.
    type: float
  kill_strays:
    description:
      - End processes that use the package outside any service (C(--kill-strays)); they are not restarted.
        Without it such processes make the run refuse.
    type: bool
    default: false
  prune:
    description:
      - Remove files the old version left behind (C(--prune)); copies are kept in the backup.
    type: bool
    default: false
  no_swap:
    description:
      - Install with uv while the units are down (C(--no-swap)), instead of staging the new version before
        the stop and renaming it into place; passed only when true.
    type: bool
    default: false
  no_smoke:
    description:
      - Do not import the new version before the stop (C(--no-smoke)); passed only when true.
    type: bool
    default: false
  keep_patches:
    description:
      - Carry the local patches of the package forward into the new version, by a three-way merge
        (C(--keep-patches)); a conflict makes the run refuse before anything stops.
      - Passed only when true, so a safeinstall without that option still runs every task that does not
        set it.
    type: bool
    default: false
  undo:
    description:
      - Undo the environment's last run that changed it (C(--undo)) instead of installing anything. What
        ran before it is put back byte for byte (local patches included) from that run's backup, through
        the same safe sequence.
      - O(name) is a guard. safeinstall refuses (nothing changed) when that run was of another package,
        or when the environment changed since it.
      - Takes neither O(wheel) nor O(requirement).
    type: bool
    default: false
  undo_run:
    description:
      - With O(undo), the run to undo (C(--run)), as C(safeinstall --status) lists it; default the last.
    type: str
  keep_backups:
    description:
      - After a good run, keep this many newest backups of the environment (C(--keep-backups)); safeinstall's
        default is 3.
    type: int
  executable:
    description:
      - The safeinstall command on the host. It is split like a shell command line (with Python's
        C(shlex.split)), but never run by a shell, so V(/opt/safeinstall/bin/safeinstall) and
        V(/opt/safeinstall/bin/python -m safeinstall) both work. A bare name is looked up on the host's
        C(PATH) (and the sbin directories).
    type: str
    default: safeinstall
notes:
  - safeinstall keeps its state (journal, lock, backups) in C(/var/lib/safeinstall) as root;
    set C(SAFEINSTALL_STATE_DIR) in the task's C(environment) to move it.
  - If a host dies in the middle of a run, C(safeinstall --recover) on that host finishes it.
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Runs C(safeinstall --dry-run); nothing is stopped or installed.
  diff_mode:
    support: full
    details: Old and new versions, and the units restarted.
  platform:
    platforms: posix
requirements:
  - safeinstall on the host (Python 3.11 or later), and systemd.
seealso:
  - module: safeinstall.fleet.verify
author:
  - safeinstall authors
"""

EXAMPLES = r"""
- name: Install the wheel copied to the host, under the services that use vllm
  safeinstall.fleet.reinstall:
    name: vllm
    wheel: /var/tmp/wheels/vllm-0.16.0-cp38-abi3-manylinux1_x86_64.whl
    python: /opt/vllm/venv
    health_url: http://127.0.0.1:8000/health

- name: A version from the configured index
  safeinstall.fleet.reinstall:
    name: vllm
    requirement: vllm==0.16.0
    python: /opt/vllm/venv
  environment:
    UV_INDEX_URL: https://pypi.example.internal/simple

- name: Go back to what ran before the last run (the old version, its local patches included)
  safeinstall.fleet.reinstall:
    name: vllm
    undo: true
    python: /opt/vllm/venv

- name: Prepare while the service serves (every host of the play at once)
  safeinstall.fleet.reinstall:
    name: vllm
    wheel: /var/tmp/wheels/vllm-0.16.0-cp38-abi3-manylinux1_x86_64.whl
    python: /opt/vllm/venv
    phase: prepare

- name: Then commit (in a play with serial), with the window's options
  safeinstall.fleet.reinstall:
    name: vllm
    python: /opt/vllm/venv
    phase: commit
    health_url: http://127.0.0.1:8000/health

- name: Or drop the prepared run (ok and not changed when there is none)
  safeinstall.fleet.reinstall:
    name: vllm
    python: /opt/vllm/venv
    phase: discard

- name: A clean reinstall of the installed version (wipes local patches)
  safeinstall.fleet.reinstall:
    name: vllm
    python: /opt/vllm/venv
    executable: /opt/safeinstall/bin/safeinstall
"""

RETURN = r"""
rc:
  description:
    - safeinstall's exit status (0 done, 2 refused, 3 rolled back, 4 rollback failed).
    - With RV(status=not-prepared), that of C(safeinstall --status).
  returned: always
  type: int
  sample: 0
status:
  description:
    - The result's status; for a run or a commit C(done), C(rolled-back), C(rollback-failed) or C(error);
      in check mode C(would-proceed), C(would-refuse) or C(error).
    - For a prepare C(prepared) (or C(error)). For a discard C(discarded), or C(not-prepared) when there
      was none to discard. A commit or a discard in check mode returns C(prepared) or C(not-prepared).
  returned: always
  type: str
  sample: done
result:
  description:
    - safeinstall's whole C(--json) envelope (C(safeinstall_result_version), C(command), C(status),
      C(exit_code), C(data), C(errors)), as documented in safeinstall's docs/json.md. For a run, a prepare
      or a commit,
      C(data.plan) is the plan, C(data.steps) the steps with their times, C(data.downtime_s) each unit's
      downtime.
    - When a commit or a discard ends before it runs (nothing to discard, check mode, a guard), the
      C(--status) envelope it read.
    - Null when safeinstall printed no result (it could not start, or is too old).
  returned: always
  type: dict
  sample: {"safeinstall_result_version": 1, "command": "reinstall", "status": "done", "exit_code": 0}
commands:
  description: With rc 4, the commands that finish the job on the host, in order.
  returned: when rc is 4
  type: list
  elements: str
  sample: ["safeinstall --recover --python /opt/vllm/venv/bin/python", "systemctl start vllm.service"]
cmd:
  description: The command that ran, one argument per item.
  returned: always
  type: list
  elements: str
stderr:
  description: safeinstall's standard error.
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
    PHASES,
    CommandError,
    phase_argv,
    phase_outcome,
    plan_diff,
    plan_of,
    prepared_of,
    prepared_problem,
    reinstall_environ,
    status_argv,
)
from ansible_collections.safeinstall.fleet.plugins.module_utils.host import (
    run_safeinstall,
    safeinstall_executable,
)

ARGUMENT_SPEC = {
    "name": {"type": "str"},
    "phase": {"type": "str", "choices": list(PHASES), "default": "run"},
    "prepared_max_age": {"type": "float"},
    "wheel": {"type": "path"},
    "requirement": {"type": "str"},
    "python": {"type": "str"},
    "user": {"type": "bool", "default": False},
    "with_deps": {"type": "bool", "default": False},
    "stop_timeout": {"type": "float"},
    "gpu_timeout": {"type": "float"},
    "settle": {"type": "float"},
    "health_url": {"type": "str", "no_log": True},
    "health_timeout": {"type": "float"},
    "kill_strays": {"type": "bool", "default": False},
    "prune": {"type": "bool", "default": False},
    "keep_patches": {"type": "bool", "default": False},
    "no_swap": {"type": "bool", "default": False},
    "no_smoke": {"type": "bool", "default": False},
    "undo": {"type": "bool", "default": False},
    "undo_run": {"type": "str"},
    "keep_backups": {"type": "int"},
    "executable": {"type": "str", "default": "safeinstall"},
}


def _prepared_run(module: AnsibleModule, executable: list[str]) -> None:
    """Before a commit or a discard: the environment's prepared run read from ``--status``. Ends the
    module where nothing is to be run: another package's run, or several (failed); nothing to discard
    (ok, not changed); check mode (what the commit or discard would take)."""
    params, phase = module.params, module.params["phase"]
    cmd = status_argv(executable, params)
    rc, status, stderr = run_safeinstall(module, cmd)
    if rc != 0 or status is None:
        msg = f"safeinstall --status exited {rc}: {stderr.strip()}"
        module.fail_json(msg=msg, rc=rc, status="error", result=status, cmd=cmd, stderr=stderr)
    found = prepared_of(status)
    problem = prepared_problem(params["name"], found)
    returned = {"rc": rc, "result": status, "cmd": cmd, "stderr": stderr}
    if problem is not None:
        module.fail_json(msg=f"refused, nothing changed: {problem}", status="error", **returned)
    if not found:
        if phase == "discard":
            module.exit_json(
                changed=False, msg="no prepared run to discard", status="not-prepared", **returned
            )
        if module.check_mode:
            msg = "refused, nothing changed: no prepared run to commit"
            module.fail_json(msg=msg, status="not-prepared", **returned)
        return  # the commit refuses, and says so in its own words
    if module.check_mode:
        run = found[0]
        verb = "would commit" if phase == "commit" else "would discard"
        units = ", ".join(run.units) or "no unit"
        restarts = f"; restarts {units}" if phase == "commit" else ""
        msg = f"{verb} the prepared run {run.run_id} ({'; '.join(run.changes)}){restarts}"
        module.exit_json(changed=True, msg=msg, status="prepared", **returned)


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        mutually_exclusive=[("wheel", "requirement")],
        required_if=[("phase", "run", ("name",)), ("phase", "prepare", ("name",))],
        supports_check_mode=True,
    )
    executable = safeinstall_executable(module)
    phase = module.params["phase"]
    try:
        cmd = phase_argv(executable, module.params, module.check_mode)
    except CommandError as error:
        module.fail_json(msg=str(error), rc=None, status="error", result=None, cmd=[], stderr="")
    if phase in ("commit", "discard"):
        _prepared_run(module, executable)
    rc, result, stderr = run_safeinstall(module, cmd, reinstall_environ(module.params))
    outcome = phase_outcome(phase, rc, result, stderr, module.check_mode)
    returned = {
        "changed": outcome.changed,
        "msg": outcome.msg,
        "rc": rc,
        "status": outcome.status,
        "result": result,
        "cmd": cmd,
        "stderr": stderr,
    }
    if rc == 4:
        returned["commands"] = list(outcome.commands)
    plan = plan_of(result)
    if module._diff and outcome.changed and not outcome.failed and plan is not None:
        returned["diff"] = plan_diff(plan)
    if outcome.failed:
        module.fail_json(**returned)
    module.exit_json(failed=False, **returned)  # explicit: Ansible fails a result whose rc is not 0


if __name__ == "__main__":
    main()
