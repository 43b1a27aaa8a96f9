"""Run a user's script as `python script.py` would, for the CLI's `run` and `profile`: its sys.argv, its
directory first on sys.path, `__file__` absolute, and its exit status (that of `sys.exit(...)`, 1 after an uncaught
exception, whose traceback starts at the script's own frame), so the caller can still report on the run."""
from __future__ import annotations

import os
import runpy
import sys


def run_as_main(script: str, args: list[str]) -> int:
    """Run `script` with `args`; its exit status. Never raises for what the script does. sys.argv and sys.path stay
    the script's afterwards, as under `python script.py` (its atexit handlers and threads may read them)."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(os.path.abspath(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = exit_status(e.code)
    except BaseException as e:  # noqa: BLE001  (reported as Python reports an uncaught exception)
        tb = _from_script(e.__traceback__, script)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def exit_status(code: object) -> int:
    """What the interpreter does with SystemExit(code): None is 0, an int is the status, anything else is
    printed to stderr and the status is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _from_script(tb, script: str):
    """The traceback from the script's first frame on, without runpy's and the caller's frames (None when the
    script never ran, e.g. a syntax error, which Python also reports without frames)."""
    path = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    return tb
