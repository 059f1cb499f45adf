"""The sentence VAEs' speed benchmark (``vae-bench``)."""
