# Shared option handling of the train_*.sh recipes (sourced, not executed).
#
# Options (each also settable through the environment variable in brackets):
#   --size base|small|tiny   model size of Table I                      [SIZE, default base]
#   --mode sdma|sma|none     SDMA-T, SMA-T or the vanilla transformer   [MODE, default sdma]
#   --data DIR               fairseq-preprocess output                  [DATA_BIN]
#   --save-dir DIR           checkpoints                                [SAVE_DIR]
#   -- ARGS...               passed to fairseq-train unchanged (e.g. --max-update 100 --cpu)
# Further environment overrides: MAX_UPDATE WARMUP LR MAX_TOKENS UPDATE_FREQ DROPOUT
# WEIGHT_DECAY SEED FAIRSEQ_TRAIN, and FP16 (auto: --fp16 where torch sees a CUDA GPU, as the
# authors' scripts train; 1: always; 0: never).

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SIZE=${SIZE:-base}
MODE=${MODE:-sdma}
EXTRA_ARGS=()

usage_from_header() {
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1" >&2
    sed -n '3,10p' "$ROOT/examples/sdma_translation/common.sh" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# parse_train_args SCRIPT "$@": fill SIZE MODE DATA_BIN SAVE_DIR EXTRA_ARGS.
parse_train_args() {
    local script=$1
    shift
    while [[ $# -gt 0 ]]; do
        case $1 in
            --size) SIZE=${2:?--size needs a value}; shift 2 ;;
            --mode) MODE=${2:?--mode needs a value}; shift 2 ;;
            --data) DATA_BIN=${2:?--data needs a value}; shift 2 ;;
            --save-dir) SAVE_DIR=${2:?--save-dir needs a value}; shift 2 ;;
            -h|--help) usage_from_header "$script" ;;
            --) shift; EXTRA_ARGS=("$@"); break ;;
            *) echo "error: unknown option $1 (fairseq-train options go after --)" >&2; usage_from_header "$script" ;;
        esac
    done
    case $SIZE in base|small|tiny) ;; *) echo "error: --size must be base, small or tiny, not '$SIZE'" >&2; exit 2 ;; esac
    case $MODE in sdma|sma|none) ;; *) echo "error: --mode must be sdma, sma or none, not '$MODE'" >&2; exit 2 ;; esac
}

# arch_for PREFIX: PREFIX, PREFIX_small or PREFIX_tiny according to SIZE.
arch_for() {
    if [[ $SIZE == base ]]; then echo "$1"; else echo "$1_$SIZE"; fi
}

# require_data_bin SRC TGT: DATA_BIN must hold a binarised SRC-TGT corpus.
require_data_bin() {
    if [[ ! -f "$DATA_BIN/dict.$1.txt" || ! -f "$DATA_BIN/dict.$2.txt" ]]; then
        echo "error: $DATA_BIN has no dict.$1.txt/dict.$2.txt; prepare the data first (scripts/prepare_*.sh)" >&2
        exit 2
    fi
}

# fairseq_cli NAME: the repository venv's fairseq-NAME, else the one on PATH.
fairseq_cli() {
    if [[ -x "$ROOT/.venv/bin/fairseq-$1" ]]; then echo "$ROOT/.venv/bin/fairseq-$1"; else echo "fairseq-$1"; fi
}

# run_fairseq_train SRC TGT ARCH [ARGS...]: the optimisation setting shared by all recipes.
run_fairseq_train() {
    local src=$1 tgt=$2 arch=$3
    shift 3
    local dropout=() fp16=()
    if [[ -n "${DROPOUT:-}" ]]; then dropout=(--dropout "$DROPOUT"); fi
    case ${FP16:-auto} in
        1) fp16=(--fp16) ;;
        0) ;;
        auto) if "$ROOT/.venv/bin/python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
                  fp16=(--fp16)
              fi ;;
        *) echo "error: FP16 must be auto, 1 or 0, not '$FP16'" >&2; exit 2 ;;
    esac
    mkdir -p "$SAVE_DIR"
    set -x
    "${FAIRSEQ_TRAIN:-$(fairseq_cli train)}" "$DATA_BIN" \
        --user-dir "$ROOT/user_dir" \
        --task translation --source-lang "$src" --target-lang "$tgt" \
        --arch "$arch" --sdma-mode "$MODE" "${dropout[@]}" "${fp16[@]}" \
        --criterion sdma_label_smoothed_cross_entropy --label-smoothing 0.1 \
        --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
        --lr "${LR:-5e-4}" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" \
        --weight-decay "${WEIGHT_DECAY:-1e-4}" \
        --max-tokens "${MAX_TOKENS:-4096}" --update-freq "${UPDATE_FREQ:-1}" --max-update "$MAX_UPDATE" \
        --save-dir "$SAVE_DIR" --seed "${SEED:-1}" --log-format simple --log-interval 100 \
        "$@" "${EXTRA_ARGS[@]}"
}
