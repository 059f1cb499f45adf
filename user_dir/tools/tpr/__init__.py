"""Commands of HUBERT: the role/part-of-speech analysis (Fig. 4)."""
