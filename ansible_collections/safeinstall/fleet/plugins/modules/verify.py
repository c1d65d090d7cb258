#!/usr/bin/python
# Copyright: the safeinstall authors. MIT License (see the repository's pyproject.toml).
"""Ansible module safeinstall.fleet.verify: which installed files drifted from their RECORD."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: verify
short_description: Report the installed files of a Python environment that drifted (local patches)
version_added: "0.1.0"
description:
  - Runs C(safeinstall --verify-only --json) on the host, which checks every file of an installed
    distribution against its C(RECORD) (sha256 and size), like C(rpm -V), and returns the drift findings
    (modified, missing, extra files...).
  - It never changes anything, so it is never V(changed), and runs the same in check mode.
  - Drift does not fail the task unless O(fail_on_drift) is set; a check that could not run (an unknown
    package, no such interpreter) always fails.
  - See the collection's C(examples/drift-report.yml) for a table of drift per host.
options:
  name:
    description:
      - The distribution to check. One of O(name) or O(all) is required.
    type: str
  all:
    description:
      - Check every distribution of the environment (C(--all)).
    type: bool
    default: false
  wheel:
    description:
      - Compare the installed files with this wheel's contents too (C(--wheel)), a path on the host.
    type: path
  python:
    description:
      - The target interpreter or venv directory on the host (C(--python)).
    type: str
  fail_on_drift:
    description:
      - Fail the task when any drift is found.
    type: bool
    default: false
  executable:
    description:
      - The safeinstall command on the host, split like a shell command line (with Python's
        C(shlex.split)) but never run by a shell; a bare name is looked up on the host's C(PATH).
    type: str
    default: safeinstall
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: It changes nothing; it runs the same in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
requirements:
  - safeinstall on the host (Python 3.11 or later).
seealso:
  - module: safeinstall.fleet.reinstall
author:
  - safeinstall authors
"""

EXAMPLES = r"""
- name: Which files of vllm were patched on this host?
  safeinstall.fleet.verify:
    name: vllm
    python: /opt/vllm/venv
  register: vllm_drift

- name: Every distribution of the environment; fail the host if anything drifted
  safeinstall.fleet.verify:
    all: true
    python: /opt/vllm/venv
    fail_on_drift: true
"""

RETURN = r"""
rc:
  description: safeinstall's exit status (0 no drift, 1 drift found, 2 could not check).
  returned: always
  type: int
  sample: 1
status:
  description: The result's status, C(clean), C(drift) or C(error).
  returned: always
  type: str
  sample: drift
drift:
  description:
    - The findings that are drift, each as in safeinstall's C(--json) (warnings such as C(hardlinked) are
      only in RV(result)).
  returned: always
  type: list
  elements: dict
  sample:
    - distribution: sipure
      path: /venv/lib/python3.11/site-packages/sipure/cli.py
      kind: modified
      detail: sha256 differs
      drift: true
drifted:
  description: Whether any drift was found.
  returned: always
  type: bool
summary:
  description: Counts, from the result (C(distributions), C(files_checked), C(drift), C(warnings)).
  returned: when safeinstall printed a result
  type: dict
counts:
  description:
    - Per distribution, the counts that C(safeinstall --metrics-file) writes for Prometheus
      (C(safeinstall_verify_files_checked), C(safeinstall_verify_drift_findings),
      C(safeinstall_verify_warning_findings)) - C(files_checked), and the findings per kind, the drift
      kinds (C(drift)) apart from the warnings (C(warnings)), every kind listed, zeros included.
    - Empty when the check could not run.
  returned: always
  type: dict
  sample:
    sipure:
      files_checked: 6
      drift: {missing: 0, modified: 1, extra: 0, outside: 0, unreadable: 0, malformed: 0, version-mismatch: 0,
              mode: 0, record-changed: 0}
      warnings: {hardlinked: 0, wheel-record: 0, shared: 0, dpkg-intact: 0, wheel-fault: 0}
result:
  description: safeinstall's whole C(--json) envelope; null when it printed none.
  returned: always
  type: dict
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
    CommandError,
    drift_findings,
    finding_counts,
    verify_argv,
    verify_outcome,
)
from ansible_collections.safeinstall.fleet.plugins.module_utils.host import (
    run_safeinstall,
    safeinstall_executable,
)

ARGUMENT_SPEC = {
    "name": {"type": "str"},
    "all": {"type": "bool", "default": False},
    "wheel": {"type": "path"},
    "python": {"type": "str"},
    "fail_on_drift": {"type": "bool", "default": False},
    "executable": {"type": "str", "default": "safeinstall"},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    executable = safeinstall_executable(module)
    try:
        cmd = verify_argv(executable, module.params)
    except CommandError as error:
        module.fail_json(msg=str(error), rc=None, status="error", counts={}, result=None, cmd=[], stderr="")
    rc, result, stderr = run_safeinstall(module, cmd)
    outcome = verify_outcome(rc, result, stderr, module.params["fail_on_drift"])
    drift = drift_findings(result)
    returned = {
        "changed": False,
        "msg": outcome.msg,
        "rc": rc,
        "status": outcome.status,
        "drift": drift,
        "drifted": bool(drift),
        "counts": finding_counts(result),
        "result": result,
        "cmd": cmd,
        "stderr": stderr,
    }
    if result is not None:
        returned["summary"] = (result.get("data") or {}).get("summary") or {}
    if outcome.failed:
        module.fail_json(**returned)
    module.exit_json(failed=False, **returned)  # explicit: Ansible fails a result whose rc is not 0


if __name__ == "__main__":
    main()
