"""``fairseq-preprocess`` in this process: fairseq's own parser and ``fairseq_cli.preprocess.main``.

The data commands binarise with it instead of starting ``fairseq-preprocess``: a second interpreter
imports torch and fairseq again (6-8 s on a 2-core machine), which a caller that already has them (a
notebook, the tests) pays for nothing. fairseq's module configures the root logger to stdout when it is
imported and adds a file handler to its logger on every call; both are undone here, so the caller's
stdout (a command's JSON summary) and logging stay as they were, and fairseq's messages go, as with the
command, to ``DESTDIR/preprocess.log`` only.
"""

import contextlib
import logging
from typing import Iterator, Sequence, Type

PREPROCESS_LOGGER = "fairseq_cli.preprocess"


@contextlib.contextmanager
def _root_logging_kept() -> Iterator[None]:
    """The root logger's handlers and level as they were on entry (``fairseq_cli.preprocess`` calls
    ``logging.basicConfig(stream=sys.stdout)`` when imported)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def fairseq_preprocess(argv: Sequence[object], error: Type[Exception]) -> None:
    """Run ``fairseq-preprocess ARGV`` here; a failure raises ``error`` naming the command and the cause."""
    argv = [str(arg) for arg in argv]
    command = "fairseq-preprocess " + " ".join(argv)
    with _root_logging_kept():  # only the first import configures the root logger
        from fairseq import options
        from fairseq_cli import preprocess

    try:
        args = options.get_preprocessing_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has written its usage line to stderr
        raise error(f"{command}: fairseq refused the arguments (exit {exit_.code})") from None
    log = logging.getLogger(PREPROCESS_LOGGER)
    handlers, propagate = list(log.handlers), log.propagate
    log.propagate = False  # to preprocess.log only, as the command's captured output was
    try:
        preprocess.main(args)
    except Exception as cause:  # noqa: BLE001  (fairseq raises bare assertions and OSErrors)
        raise error(f"{command} failed: {type(cause).__name__}: {cause}") from cause
    finally:
        for handler in [h for h in log.handlers if h not in handlers]:  # main adds a FileHandler on every call
            log.removeHandler(handler)
            handler.close()
        log.propagate = propagate
