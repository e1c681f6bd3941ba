"""URL patterns of the ops pages; included into the dashboard namespace by dashboard/urls.py."""

urlpatterns: list = []
