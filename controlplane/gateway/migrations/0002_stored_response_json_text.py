import controlplane.common.json_text
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("gateway", "0001_stored_responses"),
    ]

    operations = [
        migrations.RenameField(model_name="storedresponse", old_name="input_items_json", new_name="input_items"),
        migrations.RenameField(model_name="storedresponse", old_name="history_json", new_name="history"),
        migrations.RenameField(model_name="storedresponse", old_name="response_json", new_name="response"),
        migrations.AlterField(
            model_name="storedresponse", name="input_items", field=controlplane.common.json_text.JSONTextField()
        ),
        migrations.AlterField(
            model_name="storedresponse", name="history", field=controlplane.common.json_text.JSONTextField()
        ),
        migrations.AlterField(
            model_name="storedresponse", name="response", field=controlplane.common.json_text.JSONTextField()
        ),
    ]
