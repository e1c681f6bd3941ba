"""Money in whole micro-units (integers), so the database adds it up exactly: SQLite kept decimal
columns as floats. Existing amounts are converted exactly (common.money_migrations)."""

from decimal import Decimal

import django.core.validators
from django.db import migrations

import controlplane.common.money
from controlplane.common.money_migrations import AlterMoneyToMicros


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0005_usagerecord_error_code_keyspend'),
    ]

    operations = [
        AlterMoneyToMicros(
            model_name='creditaccount',
            name='balance',
            field=controlplane.common.money.MoneyField(default=Decimal('0')),
        ),
        AlterMoneyToMicros(
            model_name='creditaccount',
            name='held',
            field=controlplane.common.money.MoneyField(default=Decimal('0')),
        ),
        AlterMoneyToMicros(
            model_name='creditentry',
            name='amount',
            field=controlplane.common.money.MoneyField(help_text='Positive adds credits, negative spends them.'),
        ),
        AlterMoneyToMicros(
            model_name='credithold',
            name='amount',
            field=controlplane.common.money.MoneyField(validators=[django.core.validators.MinValueValidator(0)]),
        ),
        AlterMoneyToMicros(
            model_name='keyspend',
            name='spent',
            field=controlplane.common.money.MoneyField(default=Decimal('0')),
        ),
        AlterMoneyToMicros(
            model_name='pricetier',
            name='price_per_request',
            field=controlplane.common.money.MoneyField(validators=[django.core.validators.MinValueValidator(0)]),
        ),
        AlterMoneyToMicros(
            model_name='pricetier',
            name='reference_price_per_million_tokens',
            field=controlplane.common.money.MoneyField(validators=[django.core.validators.MinValueValidator(0)]),
        ),
        AlterMoneyToMicros(
            model_name='usagerecord',
            name='price_charged',
            field=controlplane.common.money.MoneyField(validators=[django.core.validators.MinValueValidator(0)]),
        ),
        AlterMoneyToMicros(
            model_name='usagerecord',
            name='reference_price',
            field=controlplane.common.money.MoneyField(help_text="This request's price at the tier's per-token reference rate.", validators=[django.core.validators.MinValueValidator(0)]),
        ),
    ]
