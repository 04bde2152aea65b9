"""Evaluation: accuracy and perplexity kept by a handoff, against the models alone."""
