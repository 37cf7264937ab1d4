"""How train.py reports an error: the message alone for operating errors, the traceback in a log.

A bad dataset line, a reward function that cannot be imported, a reward that always raises, a
full disk or an engine that will not start are operating errors with a message that says what to
fix; 50 lines of trio and torch frames above it hide it. They print as `error: <message>` (every
distinct one of an ExceptionGroup), and the traceback goes to `<run dir>/error.log` (and to the
terminal with `--debug`). A programmer error (an assert, a NameError, ...) keeps its traceback.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from pathlib import Path
from typing import TextIO

BUGS = (AssertionError, AttributeError, NameError, TypeError, IndexError, KeyError)
ERROR_LOG = "error.log"


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) ExceptionGroups, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]


def is_operating_error(error: BaseException) -> bool:
    """True when every leaf is an Exception that is not a programmer error."""
    found = leaves(error)
    return bool(found) and all(isinstance(e, Exception) and not isinstance(e, BUGS) for e in found)


def messages(error: BaseException) -> list[str]:
    """The distinct messages of the leaves, in order (a leaf with none gives its type)."""
    out: list[str] = []
    for leaf in leaves(error):
        text = str(leaf) or type(leaf).__name__
        if text not in out:
            out.append(text)
    return out


def write_error_log(run_dir: Path, error: BaseException) -> Path | None:
    """Append the traceback to `<run_dir>/error.log`; its path (None when it cannot be written)."""
    path = run_dir / ERROR_LOG
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(f"--- {datetime.datetime.now().isoformat(timespec='seconds')}\n")
            f.write("".join(traceback.format_exception(error)))
    except OSError:
        return None
    return path


def report_error(
    error: BaseException, run_dir: Path | None, *, debug: bool, stream: TextIO | None = None
) -> int:
    """Print `error` for a user (see the module doc); the process exit code (1)."""
    stream = stream or sys.stderr
    log = write_error_log(run_dir, error) if run_dir is not None else None
    if debug or not is_operating_error(error):
        traceback.print_exception(error, file=stream)
        return 1
    for text in messages(error):
        print(f"error: {text}", file=stream)
    where = f"in {log}" if log is not None else "not written"
    print(f"(traceback {where}; --debug prints it here)", file=stream, flush=True)
    return 1
