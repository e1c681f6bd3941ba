"""The model catalog and deployments: which models exist and how many replicas each should have."""
