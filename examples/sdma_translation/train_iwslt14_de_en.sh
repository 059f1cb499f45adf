#!/usr/bin/env bash
# Train SDMA-T / SMA-T / V-T on IWSLT'14 German->English (SDMA paper, Table I).
#
# Table I setting: base 512/1024 (embed/FFN), small 384/1024, tiny 256/512; 6+6 layers,
# 4 heads; n_c 8 (base) / 4 (small, tiny); lambda_k 0.01, lambda_d 1, lambda_q 100 / lambda_x 10
# (base, small) and 50 / 5 (tiny), c_g 10 (the architectures set these).  Optimisation:
# Adam (0.9, 0.98), lr 5e-4, inverse_sqrt with 8K warm-up updates (Table I: 4K-8K; the
# authors' IWSLT script: 8K), --fp16 on a GPU (their script; FP16 in common.sh),
# dropout 0.3, weight decay 1e-4, label smoothing 0.1, 4096 tokens per batch,
# 55K updates (base, small) or 99K (tiny).
#
# usage: examples/sdma_translation/train_iwslt14_de_en.sh [--size base|small|tiny]
#            [--mode sdma|sma|none] [--data DIR] [--save-dir DIR] [-- fairseq-train args]
#   data default: data/iwslt14_de_en/bin (scripts/prepare_iwslt14_de_en.sh)
#   save default: checkpoints/iwslt14_de_en_${SIZE}_${MODE}
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_train_args "${BASH_SOURCE[0]}" "$@"

DATA_BIN=${DATA_BIN:-data/iwslt14_de_en/bin}
SAVE_DIR=${SAVE_DIR:-checkpoints/iwslt14_de_en_${SIZE}_${MODE}}
if [[ $SIZE == tiny ]]; then MAX_UPDATE=${MAX_UPDATE:-99000}; else MAX_UPDATE=${MAX_UPDATE:-55000}; fi
WARMUP=${WARMUP:-8000}
DROPOUT=${DROPOUT:-0.3}
require_data_bin de en

run_fairseq_train de en "$(arch_for sdma_transformer_iwslt_de_en)"
