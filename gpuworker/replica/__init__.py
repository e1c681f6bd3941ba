"""The replica server (`python -m gpuworker serve`), one process per loaded model: the engine
behind an OpenAI-compatible HTTP API with /health, /stats, /metrics and /drain. `server` is the
process (uvicorn, draining on SIGTERM), `app` its routes, `responses` the bodies and SSE streams,
`engine_holder` the engine's life cycle, `images` a chat request's images (loaded, decoded
and preprocessed in a pool of worker processes). It imports nothing of `daemon`."""
