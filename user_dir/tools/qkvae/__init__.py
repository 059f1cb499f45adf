"""Commands of QKVAE: the Table 2 syntax/semantics probe."""
