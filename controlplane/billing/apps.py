from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "controlplane.billing"
    label = "billing"
    verbose_name = "Billing"

    def ready(self) -> None:
        from controlplane.billing import signals

        signals.connect()
