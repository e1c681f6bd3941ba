"""Dashboard pages. Views only gather what the template shows; logic lives in services/selectors."""

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.dashboard.home import home_sections


@login_required
def home(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "dashboard/home.html",
        {"role": request.user.role_label, "sections": home_sections(user=request.user)},
    )


def login_locked_out(request: HttpRequest, original_response=None, credentials=None) -> HttpResponse:
    """What django-axes answers (AXES_LOCKOUT_CALLABLE) to a login attempt for a locked-out
    username and address, on the dashboard's login and /admin alike: 429 and when to try again."""
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    minutes = max(1, round(settings.AXES_COOLOFF_TIME.total_seconds() / 60))
    context = {"username": username, "failure_limit": settings.AXES_FAILURE_LIMIT, "minutes": minutes}
    return render(request, "registration/locked_out.html", context, status=429)
