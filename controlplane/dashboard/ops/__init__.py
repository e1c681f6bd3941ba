"""Dashboard pages: ops."""
