"""One exception hierarchy; every message says what happened and what to do next (exit codes: README)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    DRIFT = 1
    REFUSED = 2
    ROLLED_BACK = 3
    ROLLBACK_FAILED = 4
    WHEEL_FAULT = 5


def one_line(value: object) -> str:
    """Pure: a value the operator gave, as a message shows it: its newlines and tabs as ``\\x0a`` and
    ``\\x09`` (as other control characters are shown), so it never splits the ``error:`` line (a
    message's own line breaks, uv's output, are kept)."""
    return str(value).replace("\t", "\\x09").replace("\n", "\\x0a")


class SafeInstallError(Exception):
    """Base of all errors safeinstall reports to the user (never as a traceback). Every error reported
    has a hint, never empty, saying what to do next (:attr:`advice`): the raiser's ``hint``, else
    :attr:`default_hint`, by what the exit code promises."""

    exit_code: ExitCode = ExitCode.REFUSED
    code: str = "error"
    default_hint: str = "nothing was changed; fix what the error says and run again (safeinstall --help)"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint  # the raiser's own (None: none; an error that wraps this one may give its own)

    @property
    def advice(self) -> str:
        """What the user is told to do next: never empty."""
        return self.hint or self.default_hint

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "hint": self.advice}


class UsageError(SafeInstallError):
    code = "usage"


class NotConfirmed(UsageError):
    """A run that would stop units, with no terminal to ask on and no ``--yes`` (apt's rule)."""

    code = "not-confirmed"


class InterpreterError(SafeInstallError):
    code = "interpreter"


class UnknownDistributionError(SafeInstallError):
    code = "unknown-distribution"


class WheelError(SafeInstallError):
    code = "wheel"


class RecordError(SafeInstallError):
    code = "record"


class PreparedRunError(SafeInstallError):
    """A prepared run (docs/prepare.md) cannot be committed or discarded: none, several, too old,
    damaged, or something it depends on changed since the prepare. Nothing was stopped."""

    code = "prepared-run"


class PlanError(SafeInstallError):
    """uv could not produce a plan, or the plan is refused (strays, missing units...)."""

    code = "plan"


class LockHeldError(SafeInstallError):
    code = "locked"


class SystemdError(SafeInstallError):
    code = "systemd"


class PatchConflict(SafeInstallError):
    """--keep-patches: a local patch cannot be carried to the new version (refused before the stop)."""

    code = "patch-conflict"


class Aborted(SafeInstallError):
    """A run that failed (or was interrupted) before any unit was stopped: nothing changed (exit 2)."""

    code = "aborted"


class StepFailed(SafeInstallError):
    """A step after the stop failed; the run rolled back (exit 3)."""

    exit_code = ExitCode.ROLLED_BACK
    code = "rolled-back"
    default_hint = (
        "everything was put back; fix what failed, then run again (safeinstall --status lists the run)"
    )


class RollbackFailed(SafeInstallError):
    """Putting things back failed too (exit 4); the message lists the commands to finish by hand, and
    ``commands`` holds them one by one (``manual_commands`` in a reinstall's ``--json``)."""

    exit_code = ExitCode.ROLLBACK_FAILED
    code = "rollback-failed"
    default_hint = "run safeinstall --recover; safeinstall --status shows what is pending"

    def __init__(self, message: str, hint: str | None = None, commands: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint)
        self.commands = commands


class SystemPackageError(SafeInstallError):
    """A reinstall of a distribution that the system's package manager owns, or that lies in a base
    site directory where uv does not install (refused before anything stops)."""

    code = "system-package"


class ExternallyManagedError(SafeInstallError):
    """A reinstall into an externally managed interpreter (PEP 668) without --break-system-packages."""

    code = "externally-managed"


class NothingToCheck(SafeInstallError):
    """``--verify-only --all`` found no distribution to check: that is not a clean result."""

    code = "nothing-to-check"
