"""URL patterns of the tenant pages; included into the dashboard namespace by dashboard/urls.py."""

from django.urls import path

from controlplane.dashboard.tenant import views

urlpatterns: list = [
    path("keys/", views.keys, name="keys"),
    path("keys/<int:key_id>/revoke/", views.key_revoke, name="key_revoke"),
    path("keys/<int:key_id>/budget/", views.key_budget, name="key_budget"),
    path("keys/<int:key_id>/edit/", views.key_edit, name="key_edit"),
    path("quickstart/", views.quickstart, name="quickstart"),
    path("usage/", views.usage, name="usage"),
    path("credits/", views.credits, name="credits"),
    path("batches/", views.batches, name="batches"),
    path("playground/", views.playground, name="playground"),
    path("playground/code/", views.playground_code, name="playground_code"),
]
