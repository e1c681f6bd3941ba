"""URL patterns of the reports pages; included into the dashboard namespace by dashboard/urls.py."""

urlpatterns: list = []
