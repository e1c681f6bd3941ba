from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "controlplane.billing"
    label = "billing"
    verbose_name = "Billing"
