"""Make the credit ledger append-only in PostgreSQL itself, not only in the ORM.

Row-level UPDATE and DELETE are refused by a trigger, so no code path (raw SQL, a cascade, a
future bug) can rewrite a tenant's history. TRUNCATE is a table-level statement and is left alone:
test databases are emptied with it. SQLite (the embedded `make run` database) relies on the ORM
guards in `billing.models`.
"""

from django.db import migrations

CREATE = """
CREATE FUNCTION billing_creditentry_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'billing_creditentry is append-only: add a correcting entry instead';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER billing_creditentry_append_only
    BEFORE UPDATE OR DELETE ON billing_creditentry
    FOR EACH ROW EXECUTE FUNCTION billing_creditentry_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS billing_creditentry_append_only ON billing_creditentry;
DROP FUNCTION IF EXISTS billing_creditentry_append_only();
"""


def _on_postgresql(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql, params=None)  # None: several statements, no placeholders

    return run


class Migration(migrations.Migration):
    dependencies = [("billing", "0002_initial")]

    operations = [migrations.RunPython(_on_postgresql(CREATE), _on_postgresql(DROP))]
