"""The fleet's writes, one module per subdomain; callers import from the module that owns the write.
Atomic; messages to workers and live events go out after commit.

- workers: registration, worker state, an operator's drain
- heartbeats: recording heartbeats, and the lost-worker judge for workers that stop sending them
- replicas: the replica state machine, placement and stopping, an operator's load and unload
- deployments: creating and editing deployments, scaling, a cold start's wake, load retries, and
  `deployment_set_desired_replicas`, the one writer of a deployment's desired replica count
- autoscaling: the autoscaler's decisions
- model_lifecycle: disabling a model (its replicas unload), enabling it again, deleting it
- staging: which checkpoints each worker keeps warm
- quality: perplexity measurements a worker runs for the catalog

Reconcile (fleet/reconcile.py) places and drains through `replicas`."""
