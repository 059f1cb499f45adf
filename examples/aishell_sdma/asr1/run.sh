#!/usr/bin/env bash
# Aishell-1 with SDMA-T (or the vanilla transformer of the same size) in a real ESPnet checkout.
#
#   ESPNET_ROOT=/path/to/espnet ./run.sh [--system sdma|vanilla] [any asr.sh option ...]
#
# egs2/aishell/asr1 (data preparation) and egs2/TEMPLATE/asr1/asr.sh are not in the pip wheel,
# so this needs an ESPnet git checkout whose Python environment can import this repository
# (pip install -e /path/to/this/repo, or the PYTHONPATH set below). It copies the configs of
# conf/ into the Aishell recipe and runs its asr.sh with every Python call going through the
# plugin's shim, which registers the SDMA classes and launches training with SDMAASRTask.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
: "${ESPNET_ROOT:?set ESPNET_ROOT to an ESPnet git checkout}"

system=sdma
if [ "${1:-}" = "--system" ]; then system=$2; shift 2; fi
case "$system" in
  sdma) asr_config=conf/tuning/train_asr_sdma_transformer.yaml ;;
  vanilla) asr_config=conf/tuning/train_asr_transformer.yaml ;;
  *) echo "run.sh: --system must be sdma or vanilla, got '$system'" >&2; exit 1 ;;
esac

# The experiment tag names what the config trains: SDMA-T with its reading (sdma_conf.reading, the same on both
# sides; the plugin's default, authors, where the config leaves it out), or the vanilla transformer.
readings=$(sed -n 's/^ *reading: *\([A-Za-z_]*\).*/\1/p' "$here/$asr_config" | sort -u)
case "$system" in
  sdma) reading=${readings:-authors} ;;
  vanilla) reading=$readings ;;
esac
case "$reading" in
  ""|authors|paper) ;;
  *) echo "run.sh: $asr_config: expected one sdma_conf.reading (authors or paper) on both sides, got: ${readings//$'\n'/ }" >&2
     exit 1 ;;
esac
asr_tag=${system}_transformer${reading:+_$reading}

recipe=$ESPNET_ROOT/egs2/aishell/asr1
if [ ! -x "$recipe/asr.sh" ]; then
  echo "run.sh: $recipe/asr.sh not found: ESPNET_ROOT must be an ESPnet checkout" >&2
  exit 1
fi
mkdir -p "$recipe/conf/tuning"
cp "$here"/conf/tuning/train_asr_sdma_transformer.yaml "$here"/conf/tuning/train_asr_transformer.yaml \
   "$recipe/conf/tuning/"
cp "$here/conf/decode_asr_transformer.yaml" "$recipe/conf/decode_asr_sdma_paper.yaml"

cd "$recipe"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
./asr.sh \
    --python "python -m espnet_plugin.bin.python_shim" \
    --lang zh \
    --audio_format wav \
    --feats_type raw \
    --speed_perturb_factors "0.9 1.0 1.1" \
    --token_type char \
    --use_lm false \
    --asr_tag "$asr_tag" \
    --asr_config "$asr_config" \
    --inference_config conf/decode_asr_sdma_paper.yaml \
    --inference_asr_model valid.acc.ave.pth \
    --train_set train \
    --valid_set dev \
    --test_sets "dev test" \
    --asr_speech_fold_length 512 \
    --asr_text_fold_length 150 \
    --lm_train_text data/train/text \
    "$@"
