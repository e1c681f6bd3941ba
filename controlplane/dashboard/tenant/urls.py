"""URL patterns of the tenant pages; included into the dashboard namespace by dashboard/urls.py."""

urlpatterns: list = []
