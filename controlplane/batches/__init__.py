"""The OpenAI Files and Batch APIs' state: uploaded files, batches, their lines and lifecycle."""
