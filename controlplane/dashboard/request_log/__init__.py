"""Dashboard pages: the request log."""
