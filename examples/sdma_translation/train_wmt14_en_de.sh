#!/usr/bin/env bash
# Train SDMA-T / SMA-T / V-T on WMT'14 English->German (SDMA paper, Table I).
#
# Table I setting: base 512/2048 (embed/FFN) with 8 heads, small 384/2048 with 8 heads,
# tiny 256/1024 with 4 heads; 6+6 layers; n_c 4; lambda_k 0.01, lambda_d 1,
# lambda_q 100 / lambda_x 10 (base, small) and 50 / 5 (tiny), c_g 10 (the architectures
# set these).  Joint 44K sentencepiece vocabulary with all embeddings shared.
# Optimisation: Adam (0.9, 0.98), lr 5e-4, inverse_sqrt with 8K warm-up updates,
# weight decay 1e-4, label smoothing 0.1, 4096 tokens per batch and GPU (raise
# UPDATE_FREQ to emulate more GPUs), 196K updates (base), 313K (small), 330K (tiny).
# Dropout: the architecture's default unless DROPOUT is set.
#
# usage: examples/sdma_translation/train_wmt14_en_de.sh [--size base|small|tiny]
#            [--mode sdma|sma|none] [--data DIR] [--save-dir DIR] [-- fairseq-train args]
#   data default: data/wmt14_en_de/bin (scripts/prepare_wmt14_en_de.sh)
#   save default: checkpoints/wmt14_en_de_${SIZE}_${MODE}
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_train_args "${BASH_SOURCE[0]}" "$@"

DATA_BIN=${DATA_BIN:-data/wmt14_en_de/bin}
SAVE_DIR=${SAVE_DIR:-checkpoints/wmt14_en_de_${SIZE}_${MODE}}
case $SIZE in
    base) MAX_UPDATE=${MAX_UPDATE:-196000} ;;
    small) MAX_UPDATE=${MAX_UPDATE:-313000} ;;
    tiny) MAX_UPDATE=${MAX_UPDATE:-330000} ;;
esac
WARMUP=${WARMUP:-8000}
require_data_bin en de

run_fairseq_train en de "$(arch_for sdma_transformer_wmt_en_de)" --share-all-embeddings
