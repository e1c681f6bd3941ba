"""The public OpenAI-compatible /v1 API: key check, limits, routing to replicas, credit holds."""
