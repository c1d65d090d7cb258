"""Test-bed callback for ansible-playbook: every task result of every host, one JSON line each, in the
file named by ``SAFEINSTALL_TEST_RECORD``, in the order the controller saw them, and each task's start
on each host. The tests read what each module returned from here, not from the human output."""

from __future__ import annotations

import json
import os
from typing import Any

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: safeinstall_record
    type: aggregate
    short_description: safeinstall's test bed, every task result as JSON lines
    description: Writes host, task, outcome and the module's whole result to $SAFEINSTALL_TEST_RECORD.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "safeinstall_record"
    CALLBACK_NEEDS_ENABLED = True

    def _write(self, line: dict[str, Any]) -> None:
        with open(os.environ["SAFEINSTALL_TEST_RECORD"], "a", encoding="utf-8") as sink:
            sink.write(json.dumps(line, default=str) + "\n")

    def _record(self, outcome: str, result: Any) -> None:
        self._write(
            {
                "host": result._host.get_name(),
                "task": result._task.get_name(),
                "outcome": outcome,
                "result": dict(result._result),
            }
        )

    def v2_runner_on_start(self, host: Any, task: Any) -> None:
        """A task handed to a worker for a host: the record's order shows which ran side by side."""
        self._write({"host": host.get_name(), "task": task.get_name(), "outcome": "started"})

    def v2_runner_on_ok(self, result: Any) -> None:
        self._record("ok", result)

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._record("failed", result)

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._record("skipped", result)

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._record("unreachable", result)
