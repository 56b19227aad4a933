"""Commands beside the pipeline: the benchmark and the GPU check."""
