"""The audit log: who changed what in the fleet, the catalog, API keys, credits and teams, and when."""
