"""URL patterns of the admins' tenant pages; included into the dashboard namespace by dashboard/urls.py."""

from django.urls import path

from controlplane.dashboard.tenants import views

urlpatterns: list = [
    path("tenants/", views.tenants, name="tenants"),
    path("tenants/<int:pk>/", views.tenant_detail, name="tenant_detail"),
    path("tenants/<int:pk>/credits/grant", views.tenant_credit_grant, name="tenant_credit_grant"),
]
