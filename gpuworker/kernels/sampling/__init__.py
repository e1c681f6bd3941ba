"""The sampler: filters (temperature, top-k/top-p/min-p, penalties) and the draw in one launch."""
