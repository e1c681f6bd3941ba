"""A key's monthly spend limit in micro-units, as every amount of money (see billing 0006)."""

import django.core.validators
from django.db import migrations

import controlplane.common.money
from controlplane.common.money_migrations import AlterMoneyToMicros


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0007_apikey_monthly_spend_limit'),
    ]

    operations = [
        AlterMoneyToMicros(
            model_name='apikey',
            name='monthly_spend_limit',
            field=controlplane.common.money.MoneyField(blank=True, help_text='Most this key may spend in a calendar month (UTC); empty means no limit beyond the credit.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
    ]
