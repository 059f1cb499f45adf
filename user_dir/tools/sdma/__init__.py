"""Commands of SDMA on trained models: LR/HR redundancy, attention and head-redundancy plots, query t-SNE, token clusters, BLEU."""
