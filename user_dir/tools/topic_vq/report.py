"""Topic model and codebook report of a ``topic_vq_sts`` checkpoint (any stage).

    topic-report --path CKPT --data DIR [--split valid] [--top-n 10] [--json OUT]

Prints and writes (JSON):

* ``ntm_perplexity``: the NTM's ELBO perplexity exp(sum_d L_NTM(d) / sum_d N_d) on the
  sentences of ``--split`` (both sentences of every pair; Miao et al. 2017), with
  ``ntm_perplexity_per_document`` their exp(mean_d L_d / N_d);
* ``coherence``: mean NPMI of each topic's ``--top-n`` words, co-occurrence counted over the
  training sentences (Lau et al. 2014), and the per-topic values with their top words;
* ``code_perplexity`` and ``codes_used``: how many codebook entries the VQ-VAE uses on the
  split's words (the paper's motivation: codebook collapse), and for each code the most
  frequent words mapped to it (the paper's Table 4 "clusters").
"""

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from user_dir.tools.hf_sentence.predict import load
from user_dir.topic_vq.model import TopicVQSTSModel
from user_dir.topic_vq.ntm import topic_coherence


def sentence_batches(task, split: str, batch_size: int):
    dataset = task.load_dataset(split) if split not in task.datasets else task.dataset(split)
    for first in range(0, len(dataset), batch_size):
        batch = dataset.collater([dataset[i] for i in range(first, min(len(dataset), first + batch_size))])
        yield batch["net_input"]


@torch.no_grad()
def report(model: TopicVQSTSModel, task, split: str = "valid", top_n: int = 10, batch_size: int = 64) -> dict:
    if not isinstance(model, TopicVQSTSModel):
        raise TypeError(f"the checkpoint holds a {type(model).__name__}, not a topic_vq_sts model")
    vocabulary = task.topic_vocabulary
    result = {"split": split, "num_topics": model.vqvae.num_codes, "topic_vocabulary": vocabulary.topic_size}
    bows, code_words = [], defaultdict(Counter)
    for net_input in sentence_batches(task, split, batch_size):
        for s in (1, 2):
            if f"words_{s}" not in net_input:
                continue
            bows.append(net_input[f"bow_{s}"])
            out, _ = model.quantised(net_input[f"words_{s}"], net_input[f"bow_{s}"])
            for word, code in zip(net_input[f"words_{s}"].flatten().tolist(), out.codes.flatten().tolist()):
                if code >= 0:
                    code_words[code][word] += 1
    usage = torch.tensor([sum(code_words[k].values()) for k in range(model.vqvae.num_codes)], dtype=torch.float64)
    probs = usage / usage.sum()
    nonzero = probs[probs > 0]
    result["code_perplexity"] = float(torch.exp(-(nonzero * nonzero.log()).sum()))
    result["codes_used"] = int((usage > 0).sum())

    result["codes"] = {str(k): [vocabulary.vq_words[w] for w, _ in code_words[k].most_common(top_n)]
                       for k in range(model.vqvae.num_codes) if code_words[k]}
    if model.ntm is not None:
        bow = torch.cat(bows)
        result["ntm_perplexity"] = model.ntm.perplexity(bow, generator=torch.Generator().manual_seed(1))
        result["ntm_perplexity_per_document"] = model.ntm.perplexity(
            bow, per_document=True, generator=torch.Generator().manual_seed(1))
        train_bow = torch.cat([n[f"bow_{s}"] for n in sentence_batches(task, "train", batch_size)
                               for s in (1, 2) if f"bow_{s}" in n])
        beta = model.ntm.beta()
        coherence = topic_coherence(beta, train_bow, top_n=min(top_n, vocabulary.topic_size))
        top = beta.topk(min(top_n, vocabulary.topic_size), dim=-1).indices
        result["coherence"] = float(coherence.mean())
        result["topics"] = [{"topic": k, "npmi": float(coherence[k]),
                             "words": [vocabulary.topic_words[i] for i in top[k].tolist()]}
                            for k in range(beta.size(0))]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="topic_vq_sts checkpoint")
    parser.add_argument("--data", required=True, help="directory with train.tsv and the split's TSV")
    parser.add_argument("--split", default="valid")
    parser.add_argument("--top-n", type=int, default=10)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    model, task = load(args.path, args.data, cpu=True)
    result = report(model, task, args.split, args.top_n)
    for key in ("ntm_perplexity", "ntm_perplexity_per_document", "coherence", "code_perplexity", "codes_used"):
        if key in result:
            print(f"{key:<28} {result[key]:.4g}")
    for topic in result.get("topics", []):
        print(f"topic {topic['topic']:>3}  NPMI {topic['npmi']:+.3f}  {' '.join(topic['words'])}")
    for code, words in result["codes"].items():
        print(f"code {code:>3}: {' '.join(words)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
