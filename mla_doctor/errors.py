"""One exception hierarchy; each error knows the exit status and host it concerns."""
from __future__ import annotations

from mla_doctor.exit_codes import ExitStatus


class MlaDoctorError(Exception):
    exit_status = ExitStatus.HOST_ERROR

    def __init__(self, message: str, host: str | None = None):
        super().__init__(message)
        self.message = message
        self.host = host

    def __str__(self) -> str:
        return f"{self.host}: {self.message}" if self.host else self.message


class UsageError(MlaDoctorError):
    """Bad options or a bad config file (names the file and line)."""

    exit_status = ExitStatus.USAGE


class ConfigFileError(UsageError):
    def __init__(self, path: str, line: int | None, message: str):
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


class UnreachableError(MlaDoctorError):
    """TCP connect, DNS, timeout, or the SSH handshake failed."""

    exit_status = ExitStatus.UNREACHABLE


class AuthError(UnreachableError):
    """The host answered but refused our credentials."""


class HostKeyError(UnreachableError):
    """The host key is unknown under the strict policy, or it changed: always refused."""


class RemoteError(MlaDoctorError):
    """A remote command failed, or the agent could not run or answer."""


class NoPythonError(RemoteError):
    pass


class SudoError(RemoteError):
    pass


class VllmNotFoundError(RemoteError):
    pass
