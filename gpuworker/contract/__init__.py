"""What crosses between processes, written once and imported by every side. Between the control
plane and the GPU workers: the Celery tasks a daemon consumes (`tasks`), the registration and
heartbeats it sends (`heartbeat`), the OpenAI-compatible request schema the gateway checks and
replicas serve (`openai_api`), and the embedded set-up's broker both sides send those tasks through
(`sqlite_broker`), and how a replica's memory splits over GPUs, which placement and a worker's
load check both go by (`placement`). Between a daemon and its spare replica processes: the hand-over of a `serve`
command (`spare_handover`). These modules import nothing else of gpuworker; the control plane imports
nothing else of gpuworker."""
