"""Commands of DisBert: the topic/codebook report and the cross-validation sweep."""
