from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0003_apikey_max_concurrent_requests'),
    ]

    operations = [
        migrations.AddField(
            model_name='apikey',
            name='purpose',
            field=models.CharField(choices=[('api', 'API'), ('playground', 'Playground session')], default='api', max_length=20),
        ),
    ]
