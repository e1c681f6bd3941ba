from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "controlplane.catalog"
    label = "catalog"
    verbose_name = "Catalog"
