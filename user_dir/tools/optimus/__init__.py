"""Commands of Optimus on a trained checkpoint: the low-resource curves and t-SNE (Figs. 3-4), label-conditional generation (Table 6)."""
