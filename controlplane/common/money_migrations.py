"""The migration operation that turns a decimal column of money into a `MoneyField` (micro-units)
and converts the amounts already stored, exactly; and back again."""

from django.db import migrations

from controlplane.common.money import MICROS_PER_UNIT


class AlterMoneyToMicros(migrations.AlterField):
    """AlterField from a DecimalField (six decimal places) to a MoneyField, keeping every amount."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        table, column = self._table_column(app_label, schema_editor, from_state)
        if schema_editor.connection.vendor == "postgresql":
            # One statement, exact (NUMERIC arithmetic): no row triggers fire (the ledger's
            # append-only trigger refuses UPDATE), and the column's constraints are kept.
            schema_editor.execute(
                f"ALTER TABLE {table} ALTER COLUMN {column} TYPE bigint "
                f"USING round({column} * {MICROS_PER_UNIT})::bigint"
            )
            return
        # SQLite kept the amounts as floats; rounding the scaled float recovers the micro-units
        # (its 15 significant digits held them, and any drift is far below half a micro-unit).
        # Rebuilding the table with the integer column then stores them as integers.
        schema_editor.execute(f"UPDATE {table} SET {column} = ROUND({column} * {MICROS_PER_UNIT})")
        super().database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        table, column = self._table_column(app_label, schema_editor, to_state)
        if schema_editor.connection.vendor == "postgresql":
            decimal = to_state.apps.get_model(app_label, self.model_name)._meta.get_field(self.name)
            schema_editor.execute(
                f"ALTER TABLE {table} ALTER COLUMN {column} TYPE "
                f"{decimal.db_type(schema_editor.connection)} "
                f"USING {column}::numeric / {MICROS_PER_UNIT}"
            )
            return
        super().database_backwards(app_label, schema_editor, from_state, to_state)
        schema_editor.execute(f"UPDATE {table} SET {column} = {column} / {MICROS_PER_UNIT}.0")

    def _table_column(self, app_label, schema_editor, state) -> tuple[str, str]:
        model = state.apps.get_model(app_label, self.model_name)
        quote = schema_editor.quote_name
        return quote(model._meta.db_table), quote(model._meta.get_field(self.name).column)

    def reduce(self, operation, app_label):
        # Merged into a later AlterField (when squashing), the conversion would be lost.
        return False

    def describe(self) -> str:
        return f"Alter field {self.name} on {self.model_name} to money in micro-units"
