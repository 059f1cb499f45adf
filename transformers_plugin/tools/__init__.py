"""Commands of the transformers adapter: the fine-tuning runs of its page."""
