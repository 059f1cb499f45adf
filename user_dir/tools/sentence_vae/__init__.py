"""Commands of the sentence VAEs (QKVAE/ADVAE, Optimus): evaluation (IW-PPL, KL, MI, AU, BLEU), generation, the speed benchmark."""
