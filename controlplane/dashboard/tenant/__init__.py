"""Dashboard pages: tenant."""
