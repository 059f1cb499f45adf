"""Run the toolkit's command-line tools as a user would, and parse their logs.

The subprocess layer of every driver that trains or decodes: the SDMA quickstart
(``sdma-demo``) and benchmarks (``sdma-bench``, ``vae-bench``), the regulariser-scale study
(``sdma-regulariser-scales``) and the sweeps (``topic-vq-runs``, ``tpr-transfer-runs``).
Everything goes through the console scripts of the running interpreter's environment
(``fairseq-train``, ``fairseq-generate``, ``glue-predict``, ...); one runner,
:func:`run_streaming`, keeps each run's full output in a log file and echoes the lines asked
for. Toolkit-free: nothing here imports fairseq (sacreBLEU is imported when a score is asked for).
"""

import json
import math
import re
import statistics
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import pipelines

REPO_ROOT = Path(pipelines.__file__).resolve().parents[1]
USER_DIR = REPO_ROOT / "user_dir"  # fairseq's --user-dir (the package next to this one)


def console_script(name: str) -> str:
    """``fairseq-train`` etc. of the running interpreter's environment."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise SystemExit(f"{path} not found: run `make install` first")
    return str(path)


def slug(system: str) -> str:
    """A system's run folder name (``SDMA-T paper`` -> ``SDMA-T-paper``), as the run drivers lay out their runs."""
    return system.replace(" ", "-")


def stage(message: str) -> None:
    print(f"[sdma] {message}", flush=True)


class CpuContentionMonitor:
    """Samples, once a ``period``, how much CPU the whole machine and one process tree have used
    (Linux ``/proc``), so that a run's timed intervals can be split into those during which other
    processes competed for the cores and those during which they did not.

    ``samples``: ``(seconds since start, machine busy CPU-seconds, tree busy CPU-seconds)``.
    Without ``/proc`` (not Linux) it records nothing and every interval counts as uncontended.
    """

    def __init__(self, pid: int, period: float = 1.0):
        self.pid, self.period = pid, period
        self.samples: List[tuple] = []
        self.available = os.path.exists("/proc/stat") and os.path.exists(f"/proc/{pid}/stat")
        self._tick = os.sysconf("SC_CLK_TCK") if self.available else 100
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.time()

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _machine_busy(self) -> float:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return (sum(values[:8]) - idle) / self._tick

    def _tree_busy(self) -> float:
        """CPU-seconds of ``pid`` and its live descendants (e.g. data-loader workers)."""
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick)
        if self.pid not in stats:
            raise ValueError("the process has exited")  # its CPU time is gone from /proc: no sample
        tree, frontier = {self.pid}, [self.pid]
        while frontier:
            parent = frontier.pop()
            children = [p for p, (ppid, _) in stats.items() if ppid == parent and p not in tree]
            tree.update(children)
            frontier.extend(children)
        return sum(stats[p][1] for p in tree if p in stats)

    def sample(self) -> None:
        try:
            self.samples.append((time.time() - self._start, self._machine_busy(), self._tree_busy()))
        except (OSError, ValueError, IndexError):
            pass

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.period):
            self.sample()
        self.sample()

    def other_cores(self, start: float, end: float) -> float:
        """Mean number of cores used by processes outside the tree between ``start`` and ``end``
        (seconds since the monitor started); NaN when fewer than two samples cover the span."""
        inside = [s for s in self.samples if start - self.period <= s[0] <= end + self.period]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return float("nan")
        (t0, m0, p0), (t1, m1, p1) = inside[0], inside[-1]
        return max(0.0, ((m1 - m0) - (p1 - p0)) / (t1 - t0))


def run_streaming(cmd: Sequence, log_path: Path, echo_filter: Optional[str] = None,
                  wrap_rss: bool = False, echo: bool = True, monitor_cpu: bool = False) -> Dict:
    """Run ``cmd``; echo lines matching ``echo_filter`` (all if None; none without ``echo``);
    keep the full log (stdout and stderr) in ``log_path``. SystemExit with the log's tail when
    the command fails.

    With ``wrap_rss`` the command (a console script) runs under ``benchmarks.peak_rss``, which
    reports the process's peak resident memory (``peak_rss_mb``) and, when it used CUDA, the peak of
PyTorch's CUDA allocator (``peak_cuda_mb``) when it exits. With
    ``monitor_cpu`` a :class:`CpuContentionMonitor` watches it (``result["cpu_monitor"]``; its
    clock starts with the command, as ``line_seconds`` does).
    """
    cmd = [str(c) for c in cmd]
    if wrap_rss:
        cmd = [sys.executable, "-m", "benchmarks.peak_rss", *cmd]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    lines: List[str] = []
    arrived: List[float] = []
    pattern = re.compile(echo_filter) if echo_filter else None
    monitor = None
    with open(log_path, "w") as log, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        if monitor_cpu:
            monitor = CpuContentionMonitor(proc.pid)
            monitor._start = start
            monitor.__enter__()
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line)
                arrived.append(time.time() - start)
                if echo and (pattern is None or pattern.search(line)):
                    print("    " + line.rstrip()[-200:], flush=True)
            proc.wait()
        finally:
            if monitor is not None:
                monitor.__exit__(None, None, None)
    if proc.returncode != 0:
        tail = "".join(lines[-40:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}\nfull log: {log_path}")
    text = "".join(lines)
    # line_seconds[i]: when lines[i] arrived, in seconds after the start (fairseq flushes each line)
    result = {"log": text, "seconds": time.time() - start, "lines": lines, "line_seconds": arrived,
              "cpu_monitor": monitor}
    for key in ("peak_rss_mb", "peak_cuda_mb"):
        match = re.search(rf"{key.upper()}=([0-9.]+)", text)
        if match:
            result[key] = float(match.group(1))
    return result


def finished(log: Path) -> bool:
    """True when ``log`` is the log of a ``fairseq-train`` run that reached its end."""
    return log.is_file() and "done training" in log.read_text()


def fairseq_train(arguments: Sequence, log: Path) -> Dict:
    """``fairseq-train ARGUMENTS`` with stdout and stderr in ``log`` (nothing echoed): the
    :func:`run_streaming` result; SystemExit with the log's tail when it fails."""
    return run_streaming([console_script("fairseq-train"), *arguments], log, echo=False)


def test_scores(checkpoint: Path, data: Path, out: Path) -> Dict[str, float]:
    """``glue-predict`` on ``data``'s test split (predictions in ``out``) -> its metrics (the JSON
    line it prints last on stdout); {} for an unlabelled test file (GLUE's)."""
    cmd = [console_script("glue-predict"), "--path", str(checkpoint), "--data", str(data),
           "--split", "test", "--out", str(out), "--cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"glue-predict failed on {checkpoint}: {proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


test_scores.__test__ = False  # a library function, not a pytest test


def train_words_per_second(log: str, skip_first: int = 1) -> float:
    """Mean of fairseq's per-interval ``wps`` (train_inner lines), skipping warm-up intervals."""
    values = [float(v) for v in re.findall(r"train_inner \|.*?wps=([0-9.]+)", log)]
    values = values[skip_first:] or values
    if not values:
        values = [float(v) for v in re.findall(r"\| train \|.*?\| wps ([0-9.]+)", log)]
    return sum(values) / len(values) if values else float("nan")


def train_inner_intervals(log: str) -> List[Dict[str, float]]:
    """fairseq's logged training intervals (``train_inner`` lines) in order: ``num_updates`` at the
    interval's end, ``wps`` (words/s), ``wpb`` (words per batch) and ``loss``."""
    intervals = []
    for line in log.splitlines():
        if "train_inner" not in line:
            continue
        fields = dict(re.findall(r"(\w+)=([-+0-9.eE]+|nan|inf)", line))
        if {"num_updates", "wps", "wpb"} <= fields.keys():
            intervals.append({"num_updates": int(fields["num_updates"]), "wps": float(fields["wps"]),
                              "wpb": float(fields["wpb"]), "loss": float(fields.get("loss", "nan"))})
    return intervals


def segment_words_per_second(log: str, start_update: int = 0, skip_first: int = 1) -> Dict[str, float]:
    """Training words/s of one ``fairseq-train`` process that started (or resumed) at ``start_update``.

    Sum of words over sum of seconds of its logged intervals after the first ``skip_first``
    (the first interval holds the first steps after start-up); an interval of n updates holds
    ``wpb * n`` words in ``wpb * n / wps`` seconds. Process start-up, the final validation and
    checkpoint are outside every interval, so they do not count.
    """
    timed = []
    previous = start_update
    for interval in train_inner_intervals(log):
        n = interval["num_updates"] - previous
        previous = interval["num_updates"]
        if n > 0 and interval["wps"] > 0:
            words = interval["wpb"] * n
            timed.append((words, words / interval["wps"]))
    used = timed[skip_first:] or timed
    words, seconds = sum(w for w, _ in used), sum(s for _, s in used)
    return {"words": words, "seconds": seconds, "intervals": len(used),
            "words_per_second": words / seconds if seconds > 0 else float("nan")}


def uncontended_words_per_second(run: Dict, start_update: int = 0, skip_first: int = 1,
                                 max_other_cores: float = 0.25) -> Dict[str, float]:
    """:func:`segment_words_per_second` over the logged intervals of ``run`` (a
    :func:`run_streaming` result with ``monitor_cpu``) during which processes outside the
    training process used at most ``max_other_cores`` cores on average.

    An interval runs from the arrival of the previous ``train_inner`` line (or the first line
    after start-up) to the arrival of its own. Returns the words/s of the uncontended intervals
    and of all, and how many intervals each holds.
    """
    monitor = run.get("cpu_monitor")
    timed, previous_update, previous_time = [], start_update, None
    for line, arrived in zip(run["lines"], run["line_seconds"]):
        if previous_time is None and "begin training epoch" in line:
            previous_time = arrived
        if "train_inner" not in line:
            continue
        fields = dict(re.findall(r"(\w+)=([-+0-9.eE]+|nan|inf)", line))
        if not {"num_updates", "wps", "wpb"} <= fields.keys():
            continue
        n = int(fields["num_updates"]) - previous_update
        previous_update = int(fields["num_updates"])
        begin, previous_time = previous_time, arrived
        if n <= 0 or float(fields["wps"]) <= 0:
            continue
        words = float(fields["wpb"]) * n
        other = monitor.other_cores(begin, arrived) if (monitor is not None and begin is not None) else 0.0
        timed.append((words, words / float(fields["wps"]), other))
    timed = timed[skip_first:] or timed

    def rate(items):
        words, seconds = sum(w for w, _, _ in items), sum(s for _, s, _ in items)
        return words / seconds if seconds > 0 else float("nan")

    quiet = [t for t in timed if not (t[2] > max_other_cores)]  # NaN (unknown) counts as quiet
    return {"words_per_second": rate(quiet), "intervals": len(quiet), "all_words_per_second": rate(timed),
            "all_intervals": len(timed), "max_other_cores": max_other_cores,
            "per_interval": [{"words_per_second": w / sec, "other_cores": other} for w, sec, other in timed]}


def ratio_stats(values: Sequence[float]) -> Dict:
    """min / median / max of per-round ratios (NaN-free), and the ratios themselves."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"per_round": list(values), "min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"per_round": list(values), "min": min(finite), "median": statistics.median(finite),
            "max": max(finite)}


def resumed_update(log: str) -> int:
    """The update count of the checkpoint a ``fairseq-train`` run resumed from (0: a fresh run)."""
    match = re.search(r"[Ll]oaded checkpoint .*?\(epoch \d+ @ (\d+) updates\)", log)
    return int(match.group(1)) if match else 0


def last_num_updates(log: str) -> int:
    found = re.findall(r"num_updates[= ]([0-9]+)", log)
    return int(found[-1]) if found else 0


def valid_metric(log: str, name: str) -> float:
    """``name`` of the last ``valid`` line of a fairseq-train log (NaN when absent)."""
    found = re.findall(r"\| valid \|.*?\| " + re.escape(name) + r" ([-+0-9.eE]+|nan|inf)", log)
    return float(found[-1]) if found else float("nan")


def model_parameters(log: str) -> int:
    match = re.search(r"num\. shared model params: ([0-9,]+)", log) or re.search(
        r"num\. model params: ([0-9,]+)", log
    )
    return int(match.group(1).replace(",", "")) if match else -1


def trained_parameters(log: str) -> int:
    """fairseq's ``num. trained`` count (parameters that require gradients); -1 when not logged."""
    match = re.search(r"num\. (?:shared )?model params: [0-9,]+ \(num\. trained: ([0-9,]+)\)", log)
    return int(match.group(1).replace(",", "")) if match else -1


def generate(data_bin: Path, checkpoint: Path, out_dir: Path, subset: str = "test", beam: int = 5,
             max_tokens: int = 4000, extra: Sequence = (), cpu: bool = True) -> Dict:
    """``fairseq-generate`` with sentencepiece removal; returns hypotheses in corpus order."""
    cmd = [
        console_script("fairseq-generate"), data_bin, "--user-dir", USER_DIR, "--path", checkpoint,
        "--gen-subset", subset, "--beam", beam, "--max-tokens", max_tokens, *(["--cpu"] if cpu else []),
        "--remove-bpe", "sentencepiece",
        # fairseq-fixed drops a final batch that is not a multiple of this (8 by default):
        # with 1, every test sentence is translated
        "--required-batch-size-multiple", "1", *extra,
    ]
    result = run_streaming(cmd, out_dir / f"generate-{subset}.log", echo_filter=r"Translated|BLEU")
    hyps = {}
    for line in result["log"].splitlines():
        if line.startswith("H-"):
            ident, _, text = line.split("\t", 2)
            hyps[int(ident[2:])] = text
    match = re.search(r"Translated ([0-9,]+) sentences .*?\(([0-9.]+) sentences/s", result["log"])
    result["hypotheses"] = [hyps[i] for i in sorted(hyps)]
    result["sentences_per_second"] = float(match.group(2)) if match else float("nan")
    return result


def write_json(path: Union[str, Path], payload, announce: bool = False) -> None:
    """``payload`` as indented JSON with sorted keys, parent folders created; ``announce`` prints ``wrote PATH``.
    The one JSON writer of the drivers, benchmarks and commands."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    if announce:
        print(f"wrote {path}", flush=True)


def print_table(rows: List[Dict], columns: List[str], title: str) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(f"\n{title}")
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))
    print(flush=True)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "" if value is None else str(value)
