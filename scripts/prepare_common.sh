# Shared helpers of scripts/prepare_*.sh (sourced, not executed).

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The project's Python: $PYTHON, else the repository's .venv, else python3.
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
WORKERS=${WORKERS:-$(nproc 2>/dev/null || echo 1)}
die() { echo "error: $*" >&2; exit 2; }

# Options of prepare-translation from the environment (exit 2 on a bad value, like its own errors):
#   OVERWRITE=1            --overwrite (replace OUT_DIR/bin of a previous run)
#   MAX_POSITIONS=N        --max-positions N (the model's limit; default 1024, fairseq's)
#   TOO_LONG=truncate|skip what to do with sentences over it (default: refuse, naming them)
PREPARE_EXTRA=()
if [[ "${OVERWRITE:-0}" == 1 ]]; then PREPARE_EXTRA+=(--overwrite); fi
if [[ -n "${MAX_POSITIONS:-}" ]]; then
    [[ "$MAX_POSITIONS" =~ ^[0-9]+$ ]] || die "MAX_POSITIONS must be a number of tokens, not '$MAX_POSITIONS'"
    PREPARE_EXTRA+=(--max-positions "$MAX_POSITIONS")
fi
case "${TOO_LONG:-}" in
    "") ;;
    truncate) PREPARE_EXTRA+=(--truncate) ;;
    skip) PREPARE_EXTRA+=(--skip) ;;
    *) die "TOO_LONG must be truncate or skip, not '$TOO_LONG'" ;;
esac

# require_pair PREFIX LANG1 LANG2: both PREFIX.LANG files must exist.
require_pair() {
    local prefix=$1 lang
    for lang in "$2" "$3"; do
        [[ -f "$prefix.$lang" ]] || die "missing $prefix.$lang"
    done
}

# plain_or_sgm NAME PAIR SRC TGT RAW OUT_PREFIX: echo a prefix with plain NAME.{SRC,TGT} files.
# Uses RAW/NAME.{SRC,TGT} when present, else converts WMT's
# RAW/NAME-PAIR-src.SRC.sgm and RAW/NAME-PAIR-ref.TGT.sgm into OUT_PREFIX.{SRC,TGT}.
plain_or_sgm() {
    local name=$1 pair=$2 src=$3 tgt=$4 raw=$5 out=$6
    if [[ -f "$raw/$name.$src" && -f "$raw/$name.$tgt" ]]; then
        echo "$raw/$name"
        return
    fi
    local src_sgm="$raw/$name-$pair-src.$src.sgm" tgt_sgm="$raw/$name-$pair-ref.$tgt.sgm"
    [[ -f "$src_sgm" && -f "$tgt_sgm" ]] || die "neither $raw/$name.{$src,$tgt} nor $src_sgm + $tgt_sgm found"
    mkdir -p "$(dirname "$out")"
    "$PYTHON" -m pipelines.data.iwslt14 sgm "$src_sgm" "$out.$src" >&2
    "$PYTHON" -m pipelines.data.iwslt14 sgm "$tgt_sgm" "$out.$tgt" >&2
    echo "$out"
}

# usage_from_header FILE: print FILE's leading comment block (its usage text) and exit 2.
usage_from_header() {
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1" >&2
    exit 2
}

# parse_raw_out SCRIPT DEFAULT_OUT ARGS...: set RAW (an existing directory) and OUT from
# the wrapper's "RAW_DIR [OUT_DIR]" arguments, or print SCRIPT's usage and exit 2.
parse_raw_out() {
    local script=$1 default_out=$2
    shift 2
    [[ $# -ge 1 && $# -le 2 ]] || usage_from_header "$script"
    RAW=$1
    OUT=${2:-$default_out}
    [[ -d "$RAW" ]] || { echo "error: $RAW is not a directory" >&2; usage_from_header "$script"; }
}

# require_pair_or_usage SCRIPT PREFIX LANG1 LANG2: both PREFIX.LANG files exist, or usage.
require_pair_or_usage() {
    [[ -f "$2.$3" && -f "$2.$4" ]] || { echo "error: missing $2.{$3,$4}" >&2; usage_from_header "$1"; }
}
