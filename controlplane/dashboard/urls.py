from django.urls import path

from controlplane.dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.home, name="home"),
]
