"""What crosses between the control plane and the GPU workers, written once and imported by both
sides: the Celery tasks a daemon consumes (`tasks`), the registration and heartbeats it sends
(`heartbeat`), the OpenAI-compatible request schema the gateway checks and replicas serve
(`openai_api`), and the embedded set-up's broker both sides send those tasks through (`sqlite_broker`). These modules import nothing else of gpuworker; the control plane imports nothing
else of gpuworker."""
