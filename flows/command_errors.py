"""What a command that failed says: its one error line and its exit status (`lorapipe demo` with
several --arch says it for each demo that failed)."""
from __future__ import annotations

from lorapipe.cache.errors import one_line, user_message


def exit_code(error: Exception) -> int:
    """2 for a bad config, 1 for any other error."""
    from .config import ConfigError

    return 2 if isinstance(error, ConfigError) else 1


def error_line(error: Exception) -> str:
    """What went wrong and what to do, for an error the user can fix; else the bug's one line."""
    message = user_message(error)
    if message is not None:
        return message
    text = one_line(str(error))
    what = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return f"{what} (an internal error: its traceback is in the run's log, or rerun with --debug)"
