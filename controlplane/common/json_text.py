"""JSONTextField: JSON kept as text rather than PostgreSQL's jsonb, for documents that may hold NUL
characters (a tenant's batch lines, a model's answers), which jsonb refuses ("\\u0000 cannot be
converted to text") while JSON allows them. Read back as the value that was stored."""

import json

from django.db import models


class JSONTextField(models.TextField):
    def from_db_value(self, value, expression, connection):
        return None if value is None else json.loads(value)

    def get_prep_value(self, value):
        return None if value is None else json.dumps(value)
