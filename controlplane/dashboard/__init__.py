"""Pages for operators, tenants and admins (htmx) and their live-update consumers."""
