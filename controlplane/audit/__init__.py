"""The operators' audit log: who changed what in the fleet and the catalog, and when."""
