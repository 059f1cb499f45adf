"""Commands of Optimus: the Table 1 lambda sweep, the low-resource curves and t-SNE (Figs. 3-4), label-conditional generation (Table 6), the training-speed benchmark."""
