"""The modules' I/O on the host: find the safeinstall command, run it (an argv list: no shell, no
expansion of ``~`` or ``$VAR``) and read its ``--json`` result."""

from __future__ import annotations

from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
    CommandError,
    executable_argv,
    parse_result,
)


def safeinstall_executable(module: AnsibleModule) -> list[str]:
    """The ``executable`` option as an argv; a bare command name is looked up on the host's PATH."""
    try:
        argv = executable_argv(module.params["executable"])
    except CommandError as error:
        module.fail_json(msg=str(error), rc=None, status="error", result=None, cmd=[], stderr="")
    if "/" not in argv[0]:
        argv[0] = module.get_bin_path(argv[0], required=True)
    return argv


def run_safeinstall(
    module: AnsibleModule, cmd: list[str], environ: dict[str, str] | None = None
) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``cmd`` (with ``environ`` added to its environment); its exit status, its ``--json`` result
    (None: none printed) and its stderr."""
    rc, stdout, stderr = module.run_command(
        cmd, check_rc=False, expand_user_and_vars=False, environ_update=environ or {}
    )
    return rc, parse_result(stdout), stderr
