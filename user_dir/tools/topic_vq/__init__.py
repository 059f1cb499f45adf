"""Commands of DisBert: the topic/codebook report."""
