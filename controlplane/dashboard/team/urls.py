"""URL patterns of the team pages; included into the dashboard namespace by dashboard/urls.py."""

from django.urls import path

from controlplane.dashboard.team import views

urlpatterns: list = [
    path("team/", views.team, name="team"),
    path("tenants/<int:tenant_id>/invitations", views.team_invitation_create, name="team_invitation_create"),
    path(
        "tenants/<int:tenant_id>/invitations/<int:pk>/revoke",
        views.team_invitation_revoke,
        name="team_invitation_revoke",
    ),
    path("tenants/<int:tenant_id>/members/<int:pk>/role", views.member_role, name="member_role"),
    path("tenants/<int:tenant_id>/members/<int:pk>/remove", views.member_remove_view, name="member_remove"),
    path("staff/", views.staff, name="staff"),
    path("staff/invitations/<int:pk>/revoke", views.staff_invitation_revoke, name="staff_invitation_revoke"),
    path("invite/<str:token>/", views.invitation_accept_view, name="invitation_accept"),
]
