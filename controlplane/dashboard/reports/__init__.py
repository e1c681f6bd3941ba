"""Dashboard pages: reports."""
