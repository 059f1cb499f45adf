#!/usr/bin/env bash
# make gpu-check on a GPU machine that has PyTorch but no package index (an air-gapped cluster node,
# a lent accelerator), in two steps:
#
#   scripts/gpu_check_offline.sh fetch [PYTHON_VERSION]   # here, online: wheels + data into .gpu-offline/
#   scripts/gpu_check_offline.sh run [gpu_check options]   # there, on a copy of the repository with .gpu-offline/
#
# fetch: downloads, for CPython PYTHON_VERSION (default 3.12) on x86-64 Linux, the wheels of fairseq,
#   ESPnet and the rest of this project's stack that a PyTorch image usually lacks (versions from
#   constraints.txt; torch, numpy, transformers, scipy, sklearn, sentencepiece, sacrebleu are taken
#   from the image), the Ding dictionary (xz, from /usr/share/trans/de-en: apt-get install trans-de-en)
#   and a 12-sentence synthetic Mandarin corpus (needs espeak-ng and sox here) for the ESPnet GPU test.
# run: installs the wheels into the running python3 (no index, no dependencies), makes this checkout
#   importable and writes the project's console scripts next to python3 (what `pip install -e .` does;
#   pyproject.toml asks for Python 3.11, the stack's, which images seldom have), unpacks the dictionary to
#   /usr/share/trans/de-en (root) and runs python -m benchmarks.gpu_check with the given options.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu-offline
# what the cuda PyTorch image checked here lacked (import closure of fairseq-train --user-dir user_dir,
# the ESPnet entry points of the recipe and the plugin)
PURE="Unidecode antlr4-python3-runtime ci-sdr defusedxml espnet espnet-g2p-en espnet_tts_frontend fast-bss-eval
humanfriendly hydra-core inflect jaconv jamo jaraco.functools kaldiio librosa more-itertools nltk omegaconf
soundfile tensorboardX torch-complex typeguard audioread pooch decorator platformdirs pycparser ConfigArgParse
pytest-timeout pytest-xdist execnet accelerate"
BINARY="fairseq-fixed bitarray soxr cffi editdistance psutil"

pinned() {  # NAME==VERSION from constraints.txt, or NAME
  local pattern
  pattern=$(echo "$1" | sed 's/[-_.]/[-_.]/g')
  grep -i "^${pattern}==" constraints.txt | head -1 || true
}

case "${1:-}" in
  fetch)
    version=${2:-3.12}
    mkdir -p "$DIR/wheels"
    specs=""
    for name in $PURE; do spec=$(pinned "$name"); specs="$specs ${spec:-$name}"; done
    .venv/bin/python -m pip wheel -q --no-deps -w "$DIR/wheels" $specs
    for name in $BINARY; do
      spec=$(pinned "$name")
      .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR/wheels" "${spec:-$name}"
    done
    xz -9 -c /usr/share/trans/de-en > "$DIR/de-en.xz"
    rm -rf "$DIR/asr_build" "$DIR/asr_corpus"
    .venv/bin/python examples/aishell_sdma/asr1/run_synthetic.py --work-dir "$DIR/asr_build" --num-sentences 12 \
      --stop-stage data
    mv "$DIR/asr_build/corpus" "$DIR/asr_corpus" && rm -rf "$DIR/asr_build"
    du -sh "$DIR"
    ;;
  run)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$DIR"/wheels/*.whl
    python3 - <<'EOF'
import site, sys, tomllib
from pathlib import Path
repo = Path.cwd()
Path(site.getsitepackages()[0], "latent_structure_toolkit_repo.pth").write_text(f"{repo}\n")
scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
for name, target in scripts.items():
    module, func = target.split(":")
    script = Path(sys.executable).with_name(name)
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    script.chmod(0o755)
print(f"{len(scripts)} console scripts written next to {sys.executable}")
EOF
    mkdir -p /usr/share/trans && xz -dc "$DIR/de-en.xz" > /usr/share/trans/de-en
    export GPU_TESTS_ESPNET_CORPUS="$PWD/$DIR/asr_corpus"
    python3 -m benchmarks.gpu_check "$@"
    ;;
  *)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
