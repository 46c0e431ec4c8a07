"""Exception types and exit codes of m2export (the one table both live in).

User errors (bad input, missing optional dependency, failed accuracy check) derive from
:class:`M2ExportError`; the CLI prints them as one line plus an optional hint and exits with the
error's :attr:`~M2ExportError.exit_code` without a traceback. Bugs in m2export itself (a broken
internal invariant) are :class:`InternalError`: exit 70 with the traceback.

Messages name library parameters, not command-line flags: a parameter is written in backquotes,
```text``` or ```force=True```. :func:`render` drops the backquotes for Python users (``text``,
``force=True``); the CLI passes a ``flag_for`` that maps each parameter to its flag (``--text``,
``--force``), so one message reads right in both places.
"""

from __future__ import annotations

import enum
import re
from typing import Callable


class ExitCode(enum.IntEnum):
    """Process exit codes of every ``m2export`` verb (sysexits-style 70 for bugs; 128 + signal)."""

    OK = 0
    USER_ERROR = 1
    USAGE = 2
    ACCURACY = 3
    BACKEND_UNAVAILABLE = 4
    INTERNAL = 70
    INTERRUPTED = 130
    BROKEN_PIPE = 141
    TERMINATED = 143

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "success",
    ExitCode.USER_ERROR: "user error (bad input, an unusable folder, a failed export or build; one line + hint, "
                         "-v for a traceback)",
    ExitCode.USAGE: "bad command line (an unknown flag; a flag's value malformed or out of range, or flags that "
                    "contradict each other: wrong whatever the files say; one line naming the flag)",
    ExitCode.ACCURACY: "accuracy check failed (the failing outputs are named)",
    ExitCode.BACKEND_UNAVAILABLE: "a required backend (TensorRT, CUDA, cuTile) is unavailable",
    ExitCode.INTERNAL: "internal error (a bug: traceback printed, please report it)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C, SIGINT; an output being written is left as it was)",
    ExitCode.BROKEN_PIPE: "stdout closed by its reader (a pipe such as | head): the output stopped there, "
                          "silently (-v says so)",
    ExitCode.TERMINATED: "terminated (SIGTERM; an output being written is left as it was)",
}


def exit_codes_text(sep: str = "; ") -> str:
    """The table as text: ``0 success; 1 user error (...); ...`` (``--help`` puts one code per line)."""
    return sep.join(f"{int(c)} {c.meaning}" for c in ExitCode)


class M2ExportError(Exception):
    """A problem the user can fix. ``hint`` (optional) says how.

    Args:
        message: one line naming the file/field/value and what was expected; library parameters in
            backquotes (see the module docstring).
        hint: one line on how to fix it (same notation), or None.
    """

    exit_code: int = ExitCode.USER_ERROR

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.raw_hint = hint

    @property
    def raw_message(self) -> str:
        return self.args[0] if self.args else ""

    @property
    def hint(self) -> str | None:
        return render(self.raw_hint) if self.raw_hint else None

    def __str__(self) -> str:  # message only; the CLI prints the hint on its own line
        return render(self.raw_message)

    def render(self, flag_for: Callable[[str], str | None] | None = None) -> tuple[str, str | None]:
        """(message, hint) with parameters shown as ``flag_for(name)`` where it returns a flag."""
        return render(self.raw_message, flag_for), (render(self.raw_hint, flag_for) if self.raw_hint else None)


_PARAM = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)(?:=([^`]*))?`")


def render(text: str, flag_for: Callable[[str], str | None] | None = None) -> str:
    """Resolve the ```param``` / ```param=value``` references of an error message.

    Without ``flag_for`` (Python users) the backquotes go: ``param`` / ``param=value``. With it, a
    parameter that ``flag_for`` maps to a flag is shown as that flag: ``--flag``, ``--flag value``
    (quotes around the value dropped), or ``--flag`` alone for ``=True``.
    """
    def sub(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        flag = flag_for(name) if flag_for else None
        if flag is None:
            return name if value is None else f"{name}={value}"
        if value is None or value == "True":
            return flag
        return f"{flag} {value.strip(chr(39) + chr(34))}"

    return _PARAM.sub(sub, text)


class ContractError(M2ExportError, ValueError):
    """An SSMScan argument breaks the contract in :mod:`m2export.contract`."""


class ConfigError(M2ExportError, ValueError):
    """A model configuration field is missing, malformed or unsupported."""


#: the hint of a ConfigError for a required config.json field that is absent
MISSING_FIELD_HINT = ("config.json must give it, as the model's own config does (mamba_ssm's, or transformers' "
                      "save_pretrained); was the file edited or cut short?")


class ParameterError(M2ExportError, ValueError):
    """A library argument (a CLI option) does not fit what it is applied to (a prompt id outside the model's
    vocabulary, a tolerance for an output the export lacks, a missing ``text`` file: exit 1); the message names
    it in backquotes. A value that is wrong by itself is a :class:`UsageError`."""


class UsageError(ParameterError):
    """A library argument (a CLI option) is malformed or out of range by itself, or contradicts another one,
    whatever the files say (``opset`` 5, ``max_new_tokens`` -1, ``min`` > ``max``, ``workspace`` 'lots'): exit 2,
    the code of argparse's own refusals, so that a bad flag value is exit 2 in every verb whichever layer
    checks it. The message names the parameter in backquotes (the CLI shows its flag)."""

    exit_code = ExitCode.USAGE


class CheckpointError(M2ExportError):
    """A checkpoint file or directory is missing, malformed, or its tensors do not match the config."""


class OutputFolderError(M2ExportError):
    """A folder to write into cannot be used: not empty, a file, not writable, or unsafe to replace."""


class ExportFolderError(M2ExportError):
    """An export folder (OUTDIR) is missing or incomplete: no or a malformed m2export.json, or a graph or
    engine it lists is missing or unreadable."""


class ExportError(M2ExportError):
    """ONNX export itself failed: tracing, the ONNX checker, or an interrupted export."""


class RuntimeLoadError(M2ExportError):
    """A runtime (ONNX Runtime, TensorRT) cannot load a graph or deserialise an engine."""


class BuildError(M2ExportError):
    """TensorRT failed to build an engine (parser errors, builder failure, the plugin not used)."""


class ToleranceError(M2ExportError):
    """An accuracy comparison exceeded its tolerance."""

    exit_code = ExitCode.ACCURACY


class BackendUnavailable(M2ExportError):
    """An explicitly requested backend (cuTile, TensorRT, ONNX Runtime, CUDA) is not usable here."""

    exit_code = ExitCode.BACKEND_UNAVAILABLE


class StdoutError(M2ExportError):
    """Writing the results to stdout failed: its reader closed the pipe (exit 141, like a tool stopped by
    SIGPIPE; the CLI prints nothing for it unless -v) or the file behind it cannot take more (``> /dev/full``, a full disk: exit 1).

    Args:
        error: the OSError of the failed write or flush.
    """

    def __init__(self, error: OSError):
        import errno

        self.errno = error.errno
        if error.errno == errno.EPIPE:
            super().__init__("stdout was closed by its reader (broken pipe): the output stopped there")
            self.exit_code = ExitCode.BROKEN_PIPE
        elif error.errno == errno.EBADF:
            super().__init__("cannot write the results to stdout: it is closed (the command ran with stdout shut, "
                             "e.g. '>&-')", hint="give stdout a file or a pipe, e.g. '> /dev/null' to discard the results")
        else:
            super().__init__(f"cannot write the results to stdout: {error.strerror or error}",
                             hint="redirect stdout to a file on a device with free space")


class InternalError(Exception):
    """A bug in m2export (an internal invariant does not hold): please report it with the traceback."""

    exit_code = ExitCode.INTERNAL


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while m2export was writing an output (see :mod:`m2export._paths`).

    A BaseException (like KeyboardInterrupt) so that ``except Exception`` fallbacks in third-party code
    (torch.onnx's capture strategies) cannot swallow it. ``exit_code``: 130 (SIGINT) or 143 (SIGTERM).
    ``note`` says what became of the output (default: nothing was written).
    """

    def __init__(self, signum: int, note: str = "nothing was written"):
        import signal

        super().__init__(signum, note)
        self.signum, self.note = signum, note
        self.exit_code = ExitCode.TERMINATED if signum == signal.SIGTERM else ExitCode.INTERRUPTED
        self.name = signal.Signals(signum).name

    def __str__(self) -> str:
        return f"interrupted by {self.name}; {self.note}"
