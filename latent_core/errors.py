"""The base of the plugin's user-facing errors, and how they reach the user.

Every error the user fixes by changing an option, a configuration key or an input file
(``SDMAConfigError``, ``VAEConfigError``, ``GlueDataError``, ...) derives from
:class:`PluginConfigError` (a ``ValueError``, so ``except ValueError`` keeps working).
Raised and not caught in a command-line program (``fairseq-train --user-dir user_dir``,
``fairseq-generate``, the ESPnet launchers, ``scripts/*.py``), it is printed as one line,
argparse style, and the process exits with status 2::

    fairseq-train: error: --sdma-clusters=0: the number of GMM clusters must be an integer >= 1

Any other exception keeps its full traceback: those are defects, not user errors.
Importing ``user_dir`` or ``espnet_plugin`` installs the hook (:func:`install_excepthook`).
"""

import logging
import os
import sys
import types
from typing import Optional, Type

EXIT_STATUS = 2  # argparse's status for usage errors


class PluginConfigError(ValueError):
    """An option, configuration key or input file the user has to fix (message says which and how)."""


def option_flag(name: str) -> str:
    """The command-line spelling of a config field: ``sdma_kl_weight`` -> ``--sdma-kl-weight``."""
    return "--" + name.replace("_", "-")


def check_positive_int(option: str, value, error: Type[Exception] = ValueError, meaning: str = "") -> int:
    """``value`` when it is an integer >= 1 (``True`` is not); otherwise ``error`` naming ``option``
    and, when given, what the number means: ``--sdma-clusters=0: the number of GMM clusters must be
    an integer >= 1``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{option}={value!r}{': ' + meaning if meaning else ''} must be an integer >= 1")
    return value


def check_heads_divide(heads_option: str, heads, width_option: str, width: int,
                       error: Type[Exception] = ValueError) -> int:
    """``heads`` when it is an integer >= 1 that divides ``width`` (every head gets width / heads
    dimensions); otherwise ``error`` naming both options and the head counts that would do:
    ``--decoder-attention-heads=3 must be >= 1 and divide --decoder-embed-dim=256 (choose one of 1, 2, 4,
    8, 16)``."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or width % heads:
        divisors = ", ".join(str(h) for h in range(1, min(width, 16) + 1) if width % h == 0)
        raise error(f"{heads_option}={heads!r} must be >= 1 and divide {width_option}={width} (choose one of "
                    f"{divisors})")
    return heads


def parse_bool(value) -> bool:
    """An option's boolean value: true/false, yes/no, on/off, 1/0 (any case); ValueError otherwise
    (argparse, given it as ``type=``, reports that as an invalid value of the option)."""
    if isinstance(value, bool):
        return value
    lowered = str(value).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def program_name() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if name in ("", "-c", "-m", "__main__.py"):
        return "python"
    return name[:-3] if name.endswith(".py") else name


def report(error: BaseException) -> str:
    """The one line the user sees: ``<program>: error: <message>``."""
    message = " ".join(str(error).split("\n")) if str(error) else type(error).__name__
    return f"{program_name()}: error: {message}"


def command_error(prog: str, error) -> int:
    """How a command reports an error it caught, as argparse reports a usage error:
    ``<prog>: error: <error>`` on stderr (after what stdout holds); returns the exit status (2) for the
    command to ``return`` or pass to ``sys.exit``."""
    sys.stdout.flush()
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    return EXIT_STATUS


def _plugin_excepthook(exc_type: Type[BaseException], exc: BaseException,
                       tb: Optional[types.TracebackType]) -> None:
    if isinstance(exc, PluginConfigError):
        logging.shutdown()  # flush log files: nothing written so far is lost
        sys.stdout.flush()
        sys.stderr.write(report(exc) + "\n")
        sys.stderr.flush()
        # sys.exit() inside an excepthook is ignored by the interpreter; the process is
        # already ending with an uncaught exception, so leave with argparse's status.
        os._exit(EXIT_STATUS)
    _previous_excepthook(exc_type, exc, tb)


_previous_excepthook = sys.excepthook


def install_excepthook() -> None:
    """Report uncaught :class:`PluginConfigError` as one line with exit status 2 (idempotent)."""
    global _previous_excepthook
    if sys.excepthook is not _plugin_excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _plugin_excepthook
