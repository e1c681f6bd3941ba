from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "controlplane.accounts"
    label = "accounts"
    verbose_name = "Accounts"

    def ready(self) -> None:
        from controlplane.accounts import signals

        signals.connect()
