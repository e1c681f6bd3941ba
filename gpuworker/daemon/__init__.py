"""The host daemon (`python -m gpuworker daemon`), one per GPU host: registration and heartbeats
(agent), the Celery consumer of the worker's own queue (tasks), the replica child processes
(supervisor), GPU and CPU figures (hardware) and the checkpoints under the model roots (model_paths).
It starts replicas as processes and talks to them over HTTP only: it imports nothing of `replica`."""
