"""The user-error types every layer raises, and the wrapper that turns one into one line.

A UserError's text is one line that names the culprit (a flag, a file and line) and
says what to do. dataset/ raises DataError, model/ WeightsError; a script's main()
reports any of them the same way.
"""
import functools
import sys


class UserError(Exception):
    """Bad flags or files: str(e) is one line, printed by the script, which then exits with code 2."""


class DataError(UserError, ValueError):
    """A problem with the input data (a file and line, or a packed file's contents)."""


class WeightsError(UserError, ValueError):
    """Bad weights, an exported folder or flags that do not fit them."""


def report_user_errors(main):
    """Decorate a script's main(): a UserError becomes `error: <its line>` on stderr and exit code 2,
    instead of a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
