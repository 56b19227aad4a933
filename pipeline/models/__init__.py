"""Model facts that hold for any variant: architecture views, loading plain HF models and tokenizers, kernels, tensor bytes."""
