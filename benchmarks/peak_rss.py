"""Run a console script in this process and print its peak resident memory at exit.

``peak-rss fairseq-train ARGS...`` (or ``python -m benchmarks.peak_rss``) -> ``PEAK_RSS_MB=<MiB>``
on stdout, and ``PEAK_CUDA_MB=<MiB>`` (``torch.cuda.max_memory_allocated``) when the run used CUDA. CONSOLE_SCRIPT is the name (or the path) of a console script of this environment; it
runs through its entry point, as its wrapper in ``bin/`` would run it.
Used by the benchmarks to compare training memory.
"""

import resource
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import List, Optional


def peak_rss_kib() -> int:
    """This process's peak resident memory in KiB, counted from its last ``exec``.

    Linux: ``VmHWM`` of ``/proc/self/status`` (the high-water mark of the current address
    space). Not ``getrusage().ru_maxrss``: Linux carries that maximum across ``fork`` + ``exec``,
    so a child started by a large parent (the benchmark holds gigabytes after building the base
    models) reports the parent's size. Elsewhere ``ru_maxrss`` is the only measure.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _report() -> None:
    print(f"PEAK_RSS_MB={peak_rss_kib() / 1024:.1f}", flush=True)
    torch = sys.modules.get("torch")  # a CUDA run: the peak of PyTorch's allocator on the current device
    if torch is not None and torch.cuda.is_initialized():
        print(f"PEAK_CUDA_MB={torch.cuda.max_memory_allocated() / 2 ** 20:.1f}", flush=True)


def main(argv: Optional[List[str]] = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        raise SystemExit("usage: peak-rss CONSOLE_SCRIPT [ARGS...]")
    script = Path(argv[0])
    found = entry_points(group="console_scripts", name=script.name)
    if not found:
        raise SystemExit(f"peak-rss: {script.name} is not a console script of this environment")
    entry = next(iter(found)).load()
    sys.argv = [str(script)] + argv[1:]
    try:
        return entry()
    finally:
        _report()


if __name__ == "__main__":
    raise SystemExit(main())
