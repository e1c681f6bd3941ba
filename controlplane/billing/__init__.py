"""Price tiers, plans, the tenants' credit ledger and per-request usage records."""
