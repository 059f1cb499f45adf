"""Commands of the GLUE-style sentence-pair classifier: predictions and GLUE submission files, HANS."""
