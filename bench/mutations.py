"""On-demand mutation check: does a test notice when a check that guards data is broken?

Each mutation below is one scripted edit of safeinstall's code (a check turned off, a condition made
always true); for each, the tests named with it run against a temporary copy of the tree with that
edit made, and a mutation that no test notices is reported as *survived*. The worktree itself is never
edited. The copy runs in a throwaway venv (``--without-pip``) whose ``site-packages`` puts the copy
first and this venv's packages after it, with a ``safeinstall`` console script of its own: the tests'
subprocesses, and a detached run's ``python -I -m safeinstall``, all run the mutated code.

    .venv/bin/python bench/mutations.py --list
    .venv/bin/python bench/mutations.py           # all, after a baseline (about 45 minutes on 2 CPUs)
    .venv/bin/python bench/mutations.py --only forget-journal --only restore-check
    .venv/bin/python bench/mutations.py --check   # each mutation still applies (no test run; CI)

The unmutated tree runs first (``--no-baseline`` skips it): every named test must pass there, and a
test that is skipped (no ``/run/systemd/system``, no cgroup delegation) makes a result inconclusive,
never "killed". Exit status: 0 when every mutation was killed, 1 otherwise. Needs root, like the
tests it runs. Not part of the test suite (``testpaths`` is ``tests/``); its ``--check`` is
(``tests/test_quality.py``): a mutation whose text the code no longer has, or that names a test that
is not there, fails CI instead of being found out on demand.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("safeinstall", "tests", "fixtures", "pyproject.toml")
PROMISES = "tests/test_promises.py"
PROMISES_45 = "tests/test_promises_45.py"


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # the text replaced: it must occur exactly ``count`` times
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root
    count: int = 1


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "forget-journal",
        "safeinstall/run/commands/status.py",
        "if read_journal(state.dir) is not None:",
        "if False:",
        (f"{PROMISES}::test_forget_refuses_an_environment_whose_run_did_not_finish_or_is_running",),
        count=2,
    ),
    Mutation(
        "forget-unlocked",
        "safeinstall/run/commands/status.py",
        "    with acquire_lock(state.lock, prefix):\n        if read_journal",
        "    if True:\n        if read_journal",
        (f"{PROMISES}::test_forget_refuses_an_environment_whose_run_did_not_finish_or_is_running",),
    ),
    Mutation(
        "restore-check",
        "safeinstall/store/backup.py",
        "        if not same:\n            mismatches.append",
        "        if False:\n            mismatches.append",
        (
            f"{PROMISES}::test_a_restored_file_that_differs_from_its_backup_fails_the_rollback_with_the_"
            "commands",
        ),
    ),
    Mutation(
        "restore-writes-nothing",
        "safeinstall/store/backup.py",
        "    if saved.path in same or _same(saved, tree):\n        return False",
        "    if True:\n        return False",
        ("tests/test_backup.py::test_backup_upgrade_restore_gives_back_v1_byte_for_byte",),
    ),
    Mutation(
        "verify-digest",
        "safeinstall/env/drift.py",
        "elif expected.digest is not None and state.digest is not None and state.digest != expected.digest:",
        "elif False:",
        (
            "tests/test_verify.py::test_each_drift_kind_is_reported",
            "tests/test_verify.py::test_a_wheel_read_once_is_enough_and_a_corrupted_file_is_still_found",
        ),
    ),
    Mutation(
        "wheel-fault-by-ctime",
        "safeinstall/env/drift.py",
        "        or ctime_ns > record_ctime_ns\n",
        "",
        (
            "tests/test_verify.py::test_a_file_whose_wheel_lied_in_its_record_is_a_wheel_fault",
            "tests/test_verify.py::test_a_wheel_fault_acknowledged_is_quiet_until_its_file_changes",
        ),
    ),
    Mutation(
        "wheel-fault-acknowledged-by-identity",
        "safeinstall/env/drift.py",
        "    if now is None or kept.get(finding.path) != now:",
        "    if now is None or finding.path not in kept:",
        ("tests/test_verify.py::test_a_wheel_fault_acknowledged_is_quiet_until_its_file_changes",),
    ),
    Mutation(
        "pyc-installer-window",
        "safeinstall/env/bytecode.py",
        "    return 0 < window[0] <= ctime_ns <= window[1]",
        "    return True",
        (
            "tests/test_verify_owner.py::"
            "test_bytecode_its_installer_wrote_is_not_compiled_and_a_plant_after_is_still_reported",
        ),
    ),
    Mutation(
        "pyc-window-anchored",
        "safeinstall/env/bytecode.py",
        "    if (kept.inode, kept.record_ctime_ns) != record:\n        return None, None\n"
        "    return (kept.earliest_ns, kept.record_ctime_ns), None",
        "    return (kept.earliest_ns, record[1]), None",
        (
            "tests/test_verify_owner.py::"
            "test_bytecode_its_installer_wrote_is_not_compiled_and_a_plant_after_is_still_reported",
        ),
    ),
    Mutation(
        "plan-inactive-dependents",
        "safeinstall/scan/plan.py",
        "                or not dependent.is_active\n",
        "",
        (f"{PROMISES}::test_a_failed_or_inactive_sidecar_bound_to_the_service_is_not_planned",),
    ),
    Mutation(
        "no-restart-restarts",
        "safeinstall/run/steps/reinstall.py",
        "    if run.options.no_restart:\n        run.journal_phase(Phase.RESTARTING",
        "    if False:\n        run.journal_phase(Phase.RESTARTING",
        (f"{PROMISES}::test_no_restart_leaves_the_units_stopped_and_says_so",),
    ),
    Mutation(
        "no-restart-silent",
        "safeinstall/run/steps/reinstall.py",
        "tuple(run.units_to_restart()) if options.no_restart else ()",
        "()",
        (f"{PROMISES}::test_no_restart_leaves_the_units_stopped_and_says_so",),
    ),
    Mutation(
        "progress-pipe-unthrottled",
        "safeinstall/cli/render.py",
        "            if now - self._last_line >= PROGRESS_EVERY_S:",
        "            if True:",
        (f"{PROMISES}::test_progress_on_a_pipe_is_a_plain_line_at_most_every_5_s",),
    ),
    Mutation(
        "progress-log-unthrottled",
        "safeinstall/run/parts/results.py",
        "        if now - self._last_progress >= PROGRESS_EVERY_S:",
        "        if True:",
        (f"{PROMISES}::test_progress_on_a_pipe_is_a_plain_line_at_most_every_5_s",),
    ),
    Mutation(
        "settle-outwaits-a-failure",
        "safeinstall/system/systemd.py",
        "                if verdict is not None:\n                    return SettleOutcome(unit, verdict",
        '                if verdict is not None and (verdict == "settled" or now - started >= settle_s):\n'
        "                    return SettleOutcome(unit, verdict",
        (
            "tests/test_systemd.py::test_wait_settled_detects_failure",
            "tests/test_systemd.py::test_wait_settled_detects_automatic_restart",
        ),
    ),
    Mutation(
        "detach-stop-kills",
        "safeinstall/run/parts/detach.py",
        'STOP_TIMEOUT = "15min"',
        'STOP_TIMEOUT = "1s"',
        (f"{PROMISES}::test_systemctl_stop_of_a_detached_runs_unit_rolls_it_back",),
    ),
    # the swap (issue 26)
    Mutation(
        "swap-dist-info-last",
        "safeinstall/env/renames.py",
        "first = sorted(moves, key=lambda m: not _is_dist_info(m.path))",
        "first = sorted(moves, key=lambda m: _is_dist_info(m.path))",
        (
            "tests/test_swap.py::test_a_replaced_distributions_own_directories_trade_places_whole_and_its_dist_info_goes_first",
        ),
    ),
    Mutation(
        "swap-rollback-no-restore",
        "safeinstall/run/back/rollback.py",
        "phase_at_least(\n                run.journal, Phase.SWAPPING\n            )",
        "False",
        ("tests/test_swap.py::test_a_rename_that_fails_in_the_middle_of_the_swap_rolls_back",),
    ),
    Mutation(
        "swap-staging-never-removed",
        "safeinstall/env/renames.py",
        '    if not name.startswith(STAGING_PREFIX) or "/" in name:',
        "    if True:",
        ("tests/test_swap.py::test_a_kill_at_each_phase_around_the_swap_then_recover",),
    ),
    Mutation(
        "swap-held-ignored",
        "safeinstall/env/renames.py",
        "elif is_dir and child in own_dirs and child not in keep:",
        "elif is_dir and child in own_dirs:",
        (
            "tests/test_swap.py::test_a_directory_that_holds_what_must_stay_is_entered_never_moved_whole",
            "tests/test_swap.py::test_a_swapped_install_is_the_install_uv_makes_in_place",
        ),
    ),
    Mutation(
        "swap-identity-unchecked",
        "safeinstall/run/steps/reinstall.py",
        "    wrong = renames.moved_as_staged(staged, run.env.prefix)\n",
        "    wrong: list[str] = []\n",
        (
            "tests/test_swap.py::test_an_entry_of_the_staging_tree_replaced_before_the_swap_is_caught_in_the_window",
        ),
    ),
    # issue 35's audit: the tests that were missing
    Mutation(
        "marker-without-error-passes",
        "safeinstall/env/systemsite.py",
        "if marker is None or breaks_system_packages(extra_args, environ):",
        "if not marker or breaks_system_packages(extra_args, environ):",
        ("tests/test_system_python.py::test_a_marker_without_its_error_or_not_a_regular_file_still_refuses",),
    ),
    Mutation(
        "marker-not-a-file-ignored",
        "safeinstall/env/systemsite.py",
        '        return ""  # there, but not read (a FIFO, a link): still a marker',
        "        return None",
        ("tests/test_system_python.py::test_a_marker_without_its_error_or_not_a_regular_file_still_refuses",),
    ),
    Mutation(
        "containment-prefix-as-text",
        "safeinstall/env/containment.py",
        "return path == root or path.startswith(root if root.endswith(os.sep) else root + os.sep)",
        "return path == root or path.startswith(root)",
        ("tests/test_verify.py::test_a_link_to_a_sibling_whose_name_starts_with_the_prefixs_is_outside",),
    ),
    Mutation(
        "plan-lock-wait-unbounded",
        "safeinstall/env/uvplan.py",
        '    return {**environ, "UV_LOCK_TIMEOUT": str(wait)}',
        "    return dict(environ)",
        ("tests/test_privsep.py::test_another_user_holding_uvs_lock_cannot_stall_the_plan",),
    ),
    Mutation(
        "steering-skips-what-pth-imports",
        "safeinstall/env/environment.py",
        '            _walk_loaded(control, directory, "what site may import", budget)',
        "            pass",
        (
            "tests/test_hostile_fs.py::test_whoever_controls_what_site_or_the_interpreter_runs_is_the_"
            "environments_account[imported-module]",
            "tests/test_hostile_fs.py::test_whoever_controls_what_site_or_the_interpreter_runs_is_the_"
            "environments_account[imported-pycache]",
            "tests/test_hostile_fs.py::test_whoever_controls_what_site_or_the_interpreter_runs_is_the_"
            "environments_account[imported-in-turn]",
        ),
    ),
    Mutation(
        "output-through-others-link",
        "safeinstall/store/state.py",
        "            if info.st_uid not in (0, euid):",
        "            if False:",
        (
            "tests/test_hostile_fs.py::test_an_output_file_is_never_written_through_another_users_link"
            "[the-users-link-in-a-sticky-directory]",
        ),
    ),
    Mutation(
        "plan-only-failed-dependents-left",
        "safeinstall/scan/plan.py",
        "                or not dependent.is_active\n",
        '                or dependent.active_state == "failed"\n',
        (f"{PROMISES}::test_a_failed_or_inactive_sidecar_bound_to_the_service_is_not_planned[inactive]",),
    ),
    Mutation(
        "verify-pth-unhashed",
        "safeinstall/env/verify.py",
        "        if entry.hash is None:\n            if not _may_be_unhashed(dist, location):",
        '        if entry.hash is None or entry.path.endswith(".pth"):\n'
        "            if entry.hash is None and not _may_be_unhashed(dist, location):",
        ("tests/test_verify.py::test_a_pth_or_data_file_verifies_clean_and_is_modified_when_changed[pth]",),
    ),
    Mutation(
        "verify-data-scheme-misplaced",
        "safeinstall/env/wheel.py",
        '        "data": env.data,',
        '        "data": env.purelib,',
        ("tests/test_verify.py::test_a_pth_or_data_file_verifies_clean_and_is_modified_when_changed[data]",),
    ),
    Mutation(
        "swap-place-replaces",
        "safeinstall/env/renames.py",
        "            flags = RENAME_NOREPLACE if move.how == How.PLACE else RENAME_EXCHANGE",
        "            flags = 0 if move.how == How.PLACE else RENAME_EXCHANGE",
        ("tests/test_swap.py::test_a_placed_entry_never_replaces_what_appeared_there_since_the_plan",),
    ),
    Mutation(
        "identity-ignores-mtime",
        "safeinstall/env/inodes.py",
        "            or info.st_mtime_ns != entry.mtime_ns\n",
        "",
        ("tests/test_inodes.py::test_a_hashed_file_rewritten_before_the_install_ended_is_read_again",),
    ),
    Mutation(
        "end-check-units-only",
        "safeinstall/scan/plan.py",
        "        placement = placement_of_proc_cgroup(record.cgroup_text)\n        found.append(",
        "        placement = placement_of_proc_cgroup(record.cgroup_text)\n"
        "        if placement.unit is None:\n            continue\n        found.append(",
        ("tests/test_processes.py::test_the_end_check_reports_a_process_on_old_code_outside_any_unit",),
    ),
    Mutation(
        "recover-keeps-an-unstarted-verified-version",
        "safeinstall/run/back/recover.py",
        "return effective_phase(journal) in (Phase.VERIFIED, Phase.RESTARTING) and",
        "return effective_phase(journal) in (Phase.RESTARTING,) and",
        (
            "tests/test_crash_safety.py::test_a_kill_once_verified_of_a_version_that_crashes_on_start_then_"
            "recover_puts_the_old_back",
        ),
    ),
    Mutation(
        "steering-walk-unbounded",
        "safeinstall/env/environment.py",
        "        if depth > LOADED_DEPTH:",
        "        if False:",
        (
            "tests/test_hostile_fs.py::test_a_package_a_pth_line_imports_is_walked_within_bounds_never_out_of_it"
            "[too-deep]",
        ),
    ),
    Mutation(
        "steering-follows-links-out",
        "safeinstall/env/environment.py",
        "                if os.path.isdir(target) and not is_within(target, real_top):",
        "                if False:",
        (
            "tests/test_hostile_fs.py::test_a_package_a_pth_line_imports_is_walked_within_bounds_never_out_of_it"
            "[link-out]",
        ),
    ),
    # issue 45: the promises its audit found undefended
    Mutation(
        "verify-script-launcher-lines",
        "safeinstall/env/verify.py",
        "    if len(lines) == 2:\n        return True",
        "    if len(lines) <= 4:\n        return True",
        (
            f"{PROMISES_45}::test_lines_inserted_between_a_scripts_launcher_and_its_body_are_drift"
            "[one-line-after-shebang]",
            f"{PROMISES_45}::test_lines_inserted_between_a_scripts_launcher_and_its_body_are_drift"
            "[two-lines-after-shebang]",
        ),
    ),
    Mutation(
        "result-signals-handled",
        "safeinstall/run/commands/modes.py",
        "    ignored_until_exit()\n",
        "    pass\n",
        (
            f"{PROMISES_45}::test_a_signal_once_a_good_runs_result_is_shown_does_not_change_its_exit"
            "[result-shown]",
            f"{PROMISES_45}::test_a_signal_once_a_good_runs_result_is_shown_does_not_change_its_exit"
            "[interpreter-exit]",
        ),
    ),
    Mutation(
        "plan-lock-timeout-uncapped",
        "safeinstall/env/uvplan.py",
        "min(int(given), PLAN_LOCK_WAIT_S)",
        "int(given)",
        (f"{PROMISES_45}::test_an_operators_uv_lock_timeout_above_the_plans_bound_is_capped",),
    ),
    Mutation(
        "uv-lock-owner-holder-ignored",
        "safeinstall/env/uvplan.py",
        "if uid in (0, own_uid)]",
        "if uid == 0]",
        (f"{PROMISES_45}::test_uvs_lock_held_by_the_environments_account_refuses_the_run[account]",),
    ),
    Mutation(
        "uv-lock-root-holder-ignored",
        "safeinstall/env/uvplan.py",
        "if uid in (0, own_uid)]",
        "if uid == own_uid]",
        (f"{PROMISES_45}::test_uvs_lock_held_by_the_environments_account_refuses_the_run[root]",),
    ),
    Mutation(
        "worker-imports",
        "safeinstall/system/worker.py",
        "        sys.meta_path.insert(0, _NoImports())\n",
        "        pass\n",
        (f"{PROMISES_45}::test_an_import_in_a_worker_fails_at_once",),
    ),
    Mutation(
        "worker-dumpable",
        "safeinstall/system/children.py",
        "        _PRCTL(_PR_SET_DUMPABLE, 0)\n",
        "        pass\n",
        (f"{PROMISES_45}::test_a_worker_is_never_dumpable",),
    ),
    Mutation(
        "health-redirect-any-port",
        "safeinstall/system/health.py",
        "    return parts.scheme, parts.hostname, parts.port\n",
        "    return parts.scheme, parts.hostname, None\n",
        (f"{PROMISES_45}::test_a_health_redirect_to_another_port_is_refused",),
    ),
    Mutation(
        "health-any-2xx",
        "safeinstall/system/health.py",
        "        if status == 200:\n",
        "        if 200 <= status < 300:\n",
        (f"{PROMISES_45}::test_only_200_is_healthy",),
    ),
    Mutation(
        "pth-import-tab-is-a-path",
        "safeinstall/env/environment.py",
        'if line.startswith(("import ", "import\\t")):',
        'if line.startswith("import "):',
        (f"{PROMISES_45}::test_what_site_imports_without_an_import_space_line_is_walked[import-tab-line]",),
    ),
    Mutation(
        "sitecustomize-not-walked",
        "safeinstall/env/environment.py",
        "    names = set(_SITE_IMPORTS)\n",
        "    names = set[str]()\n",
        (
            f"{PROMISES_45}::test_what_site_imports_without_an_import_space_line_is_walked"
            "[sitecustomize-package]",
        ),
    ),
    Mutation(
        "d-state-breaks-ignored",
        "safeinstall/run/steps/reinstall.py",
        "                self.since.pop(process, None)\n",
        "                pass\n",
        (f"{PROMISES_45}::test_a_gpu_holder_in_and_out_of_d_state_is_not_stuck",),
    ),
    Mutation(
        "smoke-first-stderr-lines",
        "safeinstall/env/importcheck.py",
        "    return tuple(kept[-lines:])\n",
        "    return tuple(kept[:lines])\n",
        (f"{PROMISES_45}::test_a_failed_smoke_command_shows_its_last_lines_of_standard_error",),
    ),
    Mutation(
        "undo-other-version-ignored",
        "safeinstall/run/parts/undo.py",
        "        elif current.version != version:\n",
        "        elif False:\n",
        (f"{PROMISES_45}::test_another_version_installed_since_the_run_refuses_its_undo",),
    ),
    Mutation(
        "rolled-back-run-prunes-good-backups",
        "safeinstall/store/retention.py",
        "beyond = counted[keep:] if good_run else []",
        "beyond = counted[keep:]",
        (f"{PROMISES_45}::test_a_rolled_back_run_never_prunes_a_good_runs_backup_even_past_keep_backups",),
    ),
    Mutation(
        "recover-first-failure-wins",
        "safeinstall/run/back/recover.py",
        "        if any(f.exit_code == ExitCode.ROLLBACK_FAILED for f in self.failures):\n"
        "            return ExitCode.ROLLBACK_FAILED\n",
        "",
        (
            f"{PROMISES_45}::test_recover_of_several_environments_exits_4_when_one_is_left_down_whatever_"
            "came_first",
        ),
    ),
    Mutation(
        "rollback-restores-under-running-units",
        "safeinstall/run/back/rollback.py",
        "            if run.restart_started:\n",
        "            if False:\n",
        (f"{PROMISES_45}::test_a_rollback_after_the_restart_began_stops_the_units_before_the_restore",),
    ),
    Mutation(
        "environment-evidence-any-root",
        "safeinstall/scan/processes.py",
        "        if seen is not None and seen != scope.prefix_id:\n",
        "        if False:\n",
        (f"{PROMISES_45}::test_environment_evidence_is_not_given_to_a_process_in_another_root",),
    ),
    Mutation(
        "identity-ignores-owner",
        "safeinstall/env/inodes.py",
        "            or not owner_alone_writes(info.st_uid, info.st_mode, entry.uid)\n",
        "            or not owner_alone_writes(info.st_uid, info.st_mode, info.st_uid)\n",
        (f"{PROMISES_45}::test_a_hashed_cache_inode_of_another_owner_now_is_read_and_hashed",),
    ),
    Mutation(
        "save-patch-follows-a-late-link",
        "safeinstall/store/state.py",
        "fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)",
        "fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)",
        (f"{PROMISES_45}::test_save_patch_never_writes_through_a_link_planted_after_its_check",),
    ),
    Mutation(
        "kept-links-of-writable-inodes",
        "safeinstall/env/keep.py",
        "                if not only_caller_writes(info):\n",
        "                if False:\n",
        (f"{PROMISES_45}::test_kept_links_are_only_of_inodes_only_root_can_write",),
    ),
    Mutation(
        "smoke-shim-after-the-units-path",
        "safeinstall/env/importcheck.py",
        "    python_path = [str(shim_dir), *[p for p in variables.get("
        '"PYTHONPATH", "").split(os.pathsep) if p]]',
        "    python_path = [*[p for p in variables.get("
        '"PYTHONPATH", "").split(os.pathsep) if p], str(shim_dir)]',
        (f"{PROMISES_45}::test_the_smoke_shim_stays_ahead_of_a_units_own_pythonpath",),
    ),
    Mutation(
        "worker-dumps-core",
        "safeinstall/system/children.py",
        "    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))",
        "    pass",
        (f"{PROMISES_45}::test_a_worker_has_umask_022_and_no_core_dumps",),
    ),
    Mutation(
        "worker-keeps-the-callers-umask",
        "safeinstall/system/children.py",
        "    os.umask(0o022)\n",
        "",
        (f"{PROMISES_45}::test_a_worker_has_umask_022_and_no_core_dumps",),
    ),
    Mutation(
        "smoke-tree-left-open",
        "safeinstall/run/steps/smoke.py",
        "    if opened:\n        _close_again(run, new)\n",
        "    if False:\n        _close_again(run, new)\n",
        (
            f"{PROMISES_45}::test_the_staging_directory_opened_to_a_units_user_is_closed_once_the_check_"
            "is_done",
        ),
    ),
    Mutation(
        "journal-signal-dropped",
        "safeinstall/run/steps/reinstall.py",
        "                received.signals.extend(held)",
        "                pass",
        (f"{PROMISES_45}::test_a_signal_while_the_journal_is_written_stops_the_run_before_its_first_step",),
    ),
    Mutation(
        "late-check-ignores-only-loaded",
        "safeinstall/run/steps/reinstall.py",
        "    every = not run.options.only_loaded",
        "    every = True",
        (f"{PROMISES_45}::test_only_loaded_in_a_real_run_leaves_the_possible_users_running",),
    ),
    Mutation(
        "late-fifo-put-back",
        "safeinstall/env/renames.py",
        "info is not None and stat.S_ISREG(info.st_mode) and info.st_uid in (0, owner)",
        "info is not None and info.st_uid in (0, owner)",
        (f"{PROMISES_45}::test_only_a_late_regular_file_of_root_or_the_directorys_owner_is_put_back",),
    ),
    Mutation(
        "late-third-owner-put-back",
        "safeinstall/env/renames.py",
        "info is not None and stat.S_ISREG(info.st_mode) and info.st_uid in (0, owner)",
        "info is not None and stat.S_ISREG(info.st_mode)",
        (f"{PROMISES_45}::test_only_a_late_regular_file_of_root_or_the_directorys_owner_is_put_back",),
    ),
    # issue 45 (second helper): the promises its first pass left undefended
    Mutation(
        "early-handlers-before-the-try",
        "safeinstall/__main__.py",
        "    try:\n        # First: a signal from now on",
        "    install_early_handlers()\n    try:\n        # First: a signal from now on",
        (
            f"{PROMISES_45}::test_a_signal_just_after_the_handlers_or_the_cli_load_is_exit_2_with_an_"
            "error_line[handlers-installed]",
        ),
    ),
    Mutation(
        "early-command-outside-the-try",
        "safeinstall/__main__.py",
        (
            "        gc.freeze()\n"
            "        run_command()\n"
            "    except InterruptedEarly as interrupted:  # rich may not be loaded (yet): plain lines\n"
            '        sys.stderr.write(f"error: {interrupted.message}\\nhint: {interrupted.advice}\\n")\n'
            '        if "--json" in sys.argv[1:]:  # --json: one document on stdout, whatever happens\n'
            "            _early_envelope(interrupted)\n"
            "        sys.exit(int(interrupted.exit_code))\n"
        ),
        (
            "        pass\n"
            "    except InterruptedEarly as interrupted:  # rich may not be loaded (yet): plain lines\n"
            '        sys.stderr.write(f"error: {interrupted.message}\\nhint: {interrupted.advice}\\n")\n'
            '        if "--json" in sys.argv[1:]:  # --json: one document on stdout, whatever happens\n'
            "            _early_envelope(interrupted)\n"
            "        sys.exit(int(interrupted.exit_code))\n"
            "    gc.freeze()\n"
            "    run_command()\n"
        ),
        (
            f"{PROMISES_45}::test_a_signal_just_after_the_handlers_or_the_cli_load_is_exit_2_with_an_"
            "error_line[cli-loaded]",
        ),
    ),
    Mutation(
        "health-asked-every-half-second",
        "safeinstall/system/health.py",
        "PAUSE_S = 0.1  #",
        "PAUSE_S = 0.5  #",
        (f"{PROMISES_45}::test_the_health_url_is_asked_every_tenth_of_a_second_never_more_often",),
    ),
    Mutation(
        "main-pidfd-trusted-at-once",
        "safeinstall/system/systemd.py",
        "    trusted: bool = False  #",
        "    trusted: bool = True  #",
        ("tests/test_systemd.py::test_a_main_process_held_by_its_pidfd_is_asked_about_once_a_second",),
    ),
    Mutation(
        "main-pidfd-exit-unseen",
        "safeinstall/system/systemd.py",
        "            if held is None or not held.trusted or process_exited(held.pidfd):\n",
        "            if held is None or not held.trusted:\n",
        ("tests/test_systemd.py::test_a_main_process_held_by_its_pidfd_is_asked_about_once_a_second",),
    ),
    Mutation(
        "main-pidfd-any-cgroup",
        "safeinstall/system/systemd.py",
        "        keep = inside and not process_exited(pidfd)",
        "        keep = not process_exited(pidfd)",
        ("tests/test_systemd.py::test_a_main_process_is_held_only_in_its_units_cgroup_and_as_shown",),
    ),
    Mutation(
        "start-watch-asks-at-every-poll",
        "safeinstall/run/parts/units.py",
        "        if not self.mains.due(self.befores, time.monotonic()):\n            return\n",
        "",
        ("tests/test_service_downtime.py::test_the_wait_for_health_asks_systemd_about_once_a_second",),
    ),
    Mutation(
        "settle-asks-at-every-poll",
        "safeinstall/system/systemd.py",
        "            if now >= until or watch.due([unit], now):\n",
        "            if True:\n",
        ("tests/test_systemd.py::test_a_settle_asks_systemd_about_once_a_second",),
    ),
    Mutation(
        "health-asked-without-a-pause",
        "safeinstall/system/health.py",
        "        time.sleep(max(0.0, min(PAUSE_S, deadline - time.monotonic())))\n",
        "",
        (f"{PROMISES_45}::test_the_health_url_is_asked_every_tenth_of_a_second_never_more_often",),
    ),
    Mutation(
        "removal-answer-unasked-files",
        "safeinstall/store/backup.py",
        'strings("removed", asked_files)',
        'strings("removed")',
        (f"{PROMISES_45}::test_a_removal_workers_removed_list_counts_only_the_paths_root_asked",),
    ),
    Mutation(
        "removal-answer-unasked-dist-infos",
        "safeinstall/store/backup.py",
        'strings("removed_dist_infos", asked_dirs)',
        'strings("removed_dist_infos")',
        (f"{PROMISES_45}::test_a_removal_workers_removed_list_counts_only_the_paths_root_asked",),
    ),
    Mutation(
        "late-dropped-directory-not-made",
        "safeinstall/env/renames.py",
        "                for directory, mode in missing:\n"
        "                    live.make_dir(directory, mode)\n",
        "",
        (
            f"{PROMISES_45}::test_a_late_file_in_a_directory_the_new_version_drops_is_put_back[account]",
            f"{PROMISES_45}::test_an_accounts_run_puts_back_a_late_file_in_a_directory_the_new_version_drops",
        ),
    ),
    Mutation(
        "late-dropped-directory-of-anyone",
        "safeinstall/env/renames.py",
        " or old.st_uid != os.geteuid():",
        ":",
        (f"{PROMISES_45}::test_a_late_file_in_a_directory_the_new_version_drops_is_put_back[account]",),
    ),
    Mutation(
        "late-dropped-directory-mode-lost",
        "safeinstall/env/renames.py",
        "missing.append((directory, stat.S_IMODE(old.st_mode)))",
        "missing.append((directory, 0o755))",
        (f"{PROMISES_45}::test_a_late_file_in_a_directory_the_new_version_drops_is_put_back[account]",),
    ),
    Mutation(
        "smoke-prefetched-tree-left-open",
        "safeinstall/run/steps/smoke.py",
        "    if opened:\n        _close_again(run, new)\n",
        "    if opened and new.below:\n        _close_again(run, new)\n",
        (
            f"{PROMISES_45}::test_the_prefetched_tree_opened_to_a_units_user_is_made_private_again_once_the_"
            "check_is_done",
        ),
    ),
    Mutation(
        "stop-d-state-never-named",
        "safeinstall/system/systemd.py",
        "                if now - since >= STUCK_D_S:\n",
        "                if False:\n",
        (f"{PROMISES_45}::test_a_stop_held_up_by_a_process_in_d_state_is_named_after_3_s_not_its_timeout",),
    ),
    Mutation(
        "stop-d-state-breaks-ignored",
        "safeinstall/system/systemd.py",
        "        for gone in set(self.d_since) - seen:\n            del self.d_since[gone]\n",
        "",
        (f"{PROMISES_45}::test_a_stopping_process_in_and_out_of_d_state_is_waited_for",),
    ),
    Mutation(
        "step-detail-past-its-column",
        "safeinstall/cli/render.py",
        "    column = max(width - len(head), 20)",
        "    column = width",
        ("tests/test_render.py::test_a_steps_long_detail_wraps_within_the_detail_column",),
    ),
    Mutation(
        "one-filesystem-install-uncounted",
        "safeinstall/run/parts/preflight.py",
        '    copies = cache if link_mode != "hardlink" else 0\n',
        "    copies = 0\n",
        (
            "tests/test_retention.py::test_one_filesystem_sums_the_backup_the_run_cache_and_the_install",
            "tests/test_faults.py::test_one_filesystem_for_the_state_and_the_environment_is_one_sum_of_room",
        ),
    ),
    Mutation(
        "kept-backups-not-named",
        "safeinstall/store/retention.py",
        '    return f"{held}; dropping {names}{newest} makes the room: {commands}"\n',
        "    return held\n",
        (
            "tests/test_retention.py::test_a_refusal_for_room_names_the_fewest_oldest_kept_backups_and_the_command",
            "tests/test_faults.py::test_kept_backups_that_take_the_room_are_named_with_the_command_that_drops_them",
        ),
    ),
)


@dataclass(frozen=True, slots=True)
class Outcome:
    name: str
    verdict: str  # killed, survived, inconclusive
    detail: str
    failure: str  # the first failing assertion (what killed it)
    seconds: float


def mutated(text: str, mutation: Mutation) -> str:
    """Pure: ``text`` with the mutation made; ValueError when its text is not there as many times as
    it says (the code moved on: the mutation must be brought up to date, never silently skipped)."""
    found = text.count(mutation.old)
    if found != mutation.count:
        raise ValueError(
            f"{mutation.name}: {mutation.path} has {found} of {mutation.old!r}, not {mutation.count}"
        )
    return text.replace(mutation.old, mutation.new)


def _test_is_there(node: str) -> bool:
    """Whether the test a pytest node id names is defined in its file (a parametrized id's parameters
    aside): looked up in the source text, nothing imported."""
    path, _, name = node.partition("::")
    try:
        source = (ROOT / path).read_text()
    except OSError:
        return False
    return f"def {name.partition('[')[0]}(" in source


def problems(chosen: Sequence[Mutation]) -> list[str]:
    """What keeps ``chosen`` from running as written: a mutation whose text is not in its file as many
    times as it says, or a test it names that is not there. Nothing is run."""
    found: list[str] = []
    for m in chosen:
        try:
            mutated((ROOT / m.path).read_text(), m)
        except (OSError, ValueError) as exc:
            found.append(str(exc))
        found.extend(f"{m.name}: no test {node}" for node in m.tests if not _test_is_there(node))
    return found


def verdict(returncode: int, counts: dict[str, int]) -> tuple[str, str]:
    """Pure: a mutant's verdict from pytest's exit status and its JUnit counts. Only failing tests
    kill it; all passing (nothing skipped) is a survival; anything else is inconclusive."""
    summary = ", ".join(f"{key} {value}" for key, value in counts.items())
    if returncode == 1 and counts["failures"] + counts["errors"] > 0:
        return "killed", summary
    if returncode == 0 and counts["skipped"] == 0 and counts["tests"] > 0:
        return "survived", summary
    return "inconclusive", f"pytest exit {returncode}; {summary}"


def copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".venv", ".bench")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(source, dest / name)


def make_venv(venv: Path, tree: Path) -> Path:
    """A venv that imports safeinstall from ``tree``, everything else from this venv; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "00-mutant-tree.pth").write_text(f"{tree}\n")  # .pth lines are added in file-name order
    (site / "50-dev-packages.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    script = venv / "bin" / "safeinstall"
    script.write_text(f"#!{python}\nimport sys\nfrom safeinstall.__main__ import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return python


def junit_counts(report: Path) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError):
        return counts
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, "0"))
    return counts


def first_failure(output: str) -> str:
    """Pure: why a mutant died: the first failing comparison of pytest's output (``E   assert ...``),
    else its first ``E`` line."""
    lines = [line[1:].strip() for line in output.splitlines() if line.startswith("E ")]
    chosen = next((line for line in lines if line.startswith("assert ")), lines[0] if lines else "")
    return chosen[:200]


def run_tests(
    python: Path, tree: Path, tests: Sequence[str], report: Path, timeout: float
) -> tuple[int, dict[str, int], str]:
    """Run ``tests`` in ``tree`` with ``python``: pytest's exit status (-1: timed out), its JUnit
    counts, and the first failing assertion."""
    report.unlink(missing_ok=True)
    command = [str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--junitxml={report}"]
    try:
        proc = subprocess.run(
            [*command, *tests], cwd=tree, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return -1, junit_counts(report), "timed out"
    return proc.returncode, junit_counts(report), first_failure(proc.stdout)


def check(mutation: Mutation, python: Path, tree: Path, report: Path, timeout: float) -> Outcome:
    target = tree / mutation.path
    original = target.read_text()
    started = time.monotonic()
    target.write_text(mutated(original, mutation))
    try:
        code, counts, failure = run_tests(python, tree, mutation.tests, report, timeout)
    finally:
        target.write_text(original)
    result, detail = verdict(code, counts)
    return Outcome(mutation.name, result, detail, failure, time.monotonic() - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    parser.add_argument(
        "--check", action="store_true", help="only check that each mutation applies and its tests exist"
    )
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated tree")
    parser.add_argument("--why", action="store_true", help="show the assertion that killed each mutant")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (default 600)")
    args = parser.parse_args(argv)
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no mutation {', '.join(sorted(unknown))} (--list lists them)")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}: {m.old.strip()!r} -> {m.new.strip()!r}\n    {' '.join(m.tests)}")
        return 0
    broken = problems(chosen)  # every mutation still applies to the code as it is now
    for problem in broken:
        print(f"mutation out of date: {problem}")
    if broken or args.check:
        if not broken:
            print(f"{len(chosen)} mutations apply")
        return 1 if broken else 0
    with tempfile.TemporaryDirectory(prefix="safeinstall-mutants-") as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir()
        copy_tree(tree)
        python = make_venv(Path(scratch) / "venv", tree)
        report = Path(scratch) / "report.xml"
        tests = sorted({t for m in chosen for t in m.tests})
        if not args.no_baseline:
            code, counts, failure = run_tests(python, tree, tests, report, args.timeout * 2)
            if code != 0 or counts["skipped"] or not counts["tests"]:
                print(
                    f"baseline: the unmutated tree fails the named tests (exit {code}, {counts}): {failure}"
                )
                return 1
            print(f"baseline: {counts['tests']} tests pass on the unmutated tree")
        outcomes = []
        for m in chosen:
            outcome = check(m, python, tree, report, args.timeout)
            outcomes.append(outcome)
            print(
                f"{outcome.name:<28} {outcome.verdict:<12} {outcome.seconds:6.1f} s  {outcome.detail}",
                flush=True,
            )
            if args.why and outcome.failure:
                print(f"    {outcome.failure}", flush=True)
    survivors = [o.name for o in outcomes if o.verdict != "killed"]
    print(
        f"{len(outcomes) - len(survivors)} of {len(outcomes)} killed"
        + (f"; not killed: {', '.join(survivors)}" if survivors else "")
    )
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
