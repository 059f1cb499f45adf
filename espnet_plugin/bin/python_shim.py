#!/usr/bin/env python3
"""A ``python`` stand-in for ESPnet recipe scripts: ``asr.sh --python "python -m espnet_plugin.bin.python_shim"``.

``asr.sh`` runs every ESPnet command as ``${python} -m espnet2.bin.<tool> ...``. This
shim imports the plugin first (registering its classes), runs ``espnet2.bin.asr_train``
and ``espnet2.bin.asr_inference`` as the plugin's launchers (whose training task advances
the SDMA update counter and is what multi-GPU workers unpickle), and runs anything else
(``-m module``, ``-c code`` or ``script.py``) unchanged, except that every ``torch.load``
reads with ``weights_only=True`` (:mod:`espnet_plugin.safe_loading`).

stdout belongs to the tool: ``asr.sh`` pipes it into its files (``tokenize_text --output -`` into
``ref.trn``/``hyp.trn`` at scoring). ``python -m espnet_plugin.bin.python_shim`` imports the package
``espnet_plugin`` before this module runs, so the package's ``__init__`` is where whatever importing the
plugin and the ESPnet modules it pulls in prints is sent to stderr (ESPnet prints "Failed to import Flash
Attention ..." to stdout at import). Those modules stay imported, so the tool importing them again prints
nothing, and this module prints nothing itself.
"""

import runpy
import sys
from typing import List, Optional

REDIRECTS = {
    "espnet2.bin.asr_train": "espnet_plugin.bin.asr_train",
    "espnet2.bin.asr_inference": "espnet_plugin.bin.asr_inference",
}
USAGE = "usage: python -m espnet_plugin.bin.python_shim (-m MODULE | -c CODE | SCRIPT.py) [ARGS ...]"


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.exit(USAGE)
    import espnet_plugin  # noqa: F401  (registers the SDMA classes; its import prints nothing to stdout)
    from espnet_plugin.safe_loading import weights_only_loading

    with weights_only_loading():
        _run(argv)


def _run(argv: List[str]) -> None:
    if argv[0] == "-m" and len(argv) > 1:
        module = REDIRECTS.get(argv[1], argv[1])
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    elif argv[0] == "-c" and len(argv) > 1:
        sys.argv = ["-c"] + argv[2:]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif not argv[0].startswith("-"):
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    else:
        sys.exit(f"python_shim: unsupported interpreter option {argv[0]!r}\n{USAGE}")


if __name__ == "__main__":
    main()
