"""Dashboard pages. Views only gather what the template shows; logic lives in services/selectors."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


@login_required
def home(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/home.html", {"role": request.user.get_role_display()})
