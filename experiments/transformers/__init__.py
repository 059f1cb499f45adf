"""The transformers adapter's fine-tuning runs (STS, language modelling, translation) of its page."""
