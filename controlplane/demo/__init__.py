"""The demo that `make run` seeds (`manage.py seed_demo`): an app above all the others, since it
creates a tenant, its plan and credit, models and their deployments through each app's services."""
