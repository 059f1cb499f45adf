"""Commands of HUBERT: the Table 2 transfer protocol and the role/part-of-speech analysis (Fig. 4)."""
