"""Workers, their GPUs, and the replicas (loaded copies of a model) that run on them."""
