"""Commands of SDMA: the demo, benchmarks (FLOPs, step timing, scaling), LR/HR redundancy, plots, token clusters, BLEU, the multi-run drivers."""
