"""DeepSeek-V2/V3: multi-head latent attention over a paged latent cache."""
