"""Paged attention behind one interface (`backend.AttentionBackend`, `AttentionMetadata`): the
pure-torch reference (torch_backend) and the Triton kernels (triton_backend). Models call it; the
engine's model runner builds its metadata. Layers import one way: kernels <- attention <- models <- engine."""
