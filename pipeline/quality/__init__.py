"""Quality slices: built-in and lm-eval tasks, the prefix-caching lm-eval model, distribution drift."""
