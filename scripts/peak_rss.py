"""Run a console script in this process and print its peak resident memory at exit.

``python scripts/peak_rss.py fairseq-train ARGS...`` -> ``PEAK_RSS_MB=<MiB>`` on stdout.
Used by the benchmark to compare training memory on CPU (on a GPU the benchmark also
reads ``torch.cuda.max_memory_allocated``).
"""

import atexit
import resource
import runpy
import sys
from pathlib import Path


def _report() -> None:
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"PEAK_RSS_MB={peak_kib / 1024:.1f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: peak_rss.py CONSOLE_SCRIPT [ARGS...]")
    script = Path(sys.argv[1])
    sys.argv = [str(script)] + sys.argv[2:]
    atexit.register(_report)
    runpy.run_path(str(script), run_name="__main__")
