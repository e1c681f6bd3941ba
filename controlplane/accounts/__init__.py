"""Tenants, users with roles, and the API keys tenants call /v1 with."""
