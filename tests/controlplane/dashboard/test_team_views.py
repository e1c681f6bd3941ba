"""The team pages: a tenant's admins invite (the link shown once), set roles and remove members;
plain members only look; another tenant's people are 404; invitation links work once; admins
invite operators and admins from the staff page."""

import re
from datetime import timedelta

import pytest
from django.urls import reverse

from controlplane.accounts.models import Invitation, User
from controlplane.accounts.services import invitation_create
from controlplane.audit.models import AuditEntry
from tests.controlplane.factories import TenantFactory, UserFactory

pytestmark = pytest.mark.django_db

HTMX = {"HX-Request": "true"}
NEW_PASSWORD = "a new Pa55word for tests"


@pytest.fixture
def tenant():
    return TenantFactory(name="Acme")


@pytest.fixture
def tenant_admin(client, tenant):
    user = UserFactory(username="ada", tenant=tenant, tenant_role=User.TenantRole.ADMIN)
    client.force_login(user)
    return user


def _link(page: str) -> str:
    match = re.search(r'data-testid="invite-link">(http://[^<]+)<', page)
    assert match, "no invitation link on the page"
    return match.group(1)


def test_a_plain_member_sees_the_team_but_cannot_change_it(client, tenant):
    UserFactory(username="ada", tenant=tenant, tenant_role=User.TenantRole.ADMIN)
    member = UserFactory(username="bob", tenant=tenant)
    client.force_login(member)
    page = client.get(reverse("dashboard:team")).content.decode()
    assert 'data-username="ada"' in page and 'data-username="bob"' in page and 'id="team-read-only"' in page
    assert 'id="invite-form"' not in page and 'data-testid="member-remove"' not in page
    ada = User.objects.get(username="ada")
    for url, data in [
        (reverse("dashboard:team_invitation_create", args=[tenant.pk]), {"tenant_role": "member"}),
        (reverse("dashboard:member_role", args=[tenant.pk, ada.pk]), {"tenant_role": "member"}),
        (reverse("dashboard:member_remove", args=[tenant.pk, ada.pk]), {}),
    ]:
        assert client.post(url, data, headers=HTMX).status_code == 403, url
    ada.refresh_from_db()
    assert ada.is_active and ada.is_tenant_admin and not Invitation.objects.exists()


def test_operators_get_403_on_team_pages(client, tenant):
    client.force_login(UserFactory(role=User.Role.OPERATOR, tenant=None))
    assert client.get(reverse("dashboard:team")).status_code == 403
    assert (
        client.post(
            reverse("dashboard:team_invitation_create", args=[tenant.pk]), {"tenant_role": "member"}
        ).status_code
        == 403
    )


def test_another_tenants_team_is_404(client, tenant_admin):
    other = TenantFactory()
    stranger = UserFactory(tenant=other, tenant_role=User.TenantRole.ADMIN)
    assert (
        client.post(reverse("dashboard:team_invitation_create", args=[other.pk]), {"tenant_role": "member"}).status_code
        == 404
    )
    assert client.post(reverse("dashboard:member_remove", args=[other.pk, stranger.pk])).status_code == 404
    # Nor through the own tenant's URL with another tenant's member id.
    own_url = reverse("dashboard:member_remove", args=[tenant_admin.tenant_id, stranger.pk])
    assert client.post(own_url).status_code == 404
    stranger.refresh_from_db()
    assert stranger.is_active


def test_invite_accept_and_sign_in(client, tenant, tenant_admin):
    response = client.post(
        reverse("dashboard:team_invitation_create", args=[tenant.pk]),
        {"tenant_role": "member", "note": "Carol"},
        headers=HTMX,
    )
    page = response.content.decode()
    assert response["Cache-Control"] == "no-store" and page.lstrip().startswith('<section class="card" id="team"')
    link = _link(page)
    assert "Carol" in page and 'data-testid="invitation-row"' in page
    # The link is never shown again.
    assert link not in client.get(reverse("dashboard:team")).content.decode()

    client.logout()
    path = link.removeprefix("http://testserver")
    form = client.get(path)
    assert form.status_code == 200 and "Join Acme" in form.content.decode()
    mismatch = client.post(path, {"username": "carol", "password": NEW_PASSWORD, "password_again": "other"})
    assert "The two passwords differ." in mismatch.content.decode() and not User.objects.filter(username="carol")
    joined = client.post(path, {"username": "carol", "password": NEW_PASSWORD, "password_again": NEW_PASSWORD})
    assert joined.status_code == 302 and joined["Location"] == reverse("dashboard:home")
    carol = User.objects.get(username="carol")
    assert (carol.tenant, carol.tenant_role) == (tenant, User.TenantRole.MEMBER)
    assert client.get(reverse("dashboard:keys")).status_code == 200  # signed in as carol
    client.logout()
    used = client.get(path)
    assert used.status_code == 410 and "already been used" in used.content.decode()


def test_a_weak_password_is_said_beside_the_field(client, tenant, tenant_admin):
    created = invitation_create(created_by=tenant_admin, role=User.Role.TENANT_MEMBER, tenant=tenant)
    client.logout()
    page = client.post(
        reverse("dashboard:invitation_accept", args=[created.token]),
        {"username": "dan", "password": "123", "password_again": "123"},
    ).content.decode()
    start = page.index('id="error-password"')
    assert "too short" in page[start : page.index("</div>", start)]
    assert not User.objects.filter(username="dan").exists()


def test_expired_and_unknown_links(client, tenant, tenant_admin):
    expired = invitation_create(
        created_by=tenant_admin, role=User.Role.TENANT_MEMBER, tenant=tenant, lifetime=timedelta(seconds=-1)
    )
    client.logout()
    response = client.get(reverse("dashboard:invitation_accept", args=[expired.token]))
    assert response.status_code == 410 and "expired" in response.content.decode()
    posted = client.post(
        reverse("dashboard:invitation_accept", args=[expired.token]),
        {"username": "eve", "password": NEW_PASSWORD, "password_again": NEW_PASSWORD},
    )
    assert posted.status_code == 410 and not User.objects.filter(username="eve").exists()
    assert client.get(reverse("dashboard:invitation_accept", args=["nonsense"])).status_code == 404


def test_withdrawing_an_invitation(client, tenant, tenant_admin):
    created = invitation_create(created_by=tenant_admin, role=User.Role.TENANT_MEMBER, tenant=tenant)
    response = client.post(
        reverse("dashboard:team_invitation_revoke", args=[tenant.pk, created.invitation.pk]), headers=HTMX
    )
    assert 'data-testid="invitation-row"' not in response.content.decode()
    assert client.get(reverse("dashboard:invitation_accept", args=[created.token])).status_code == 410


def test_set_role_and_remove_through_the_page(client, tenant, tenant_admin):
    bob = UserFactory(username="bob", tenant=tenant)
    page = client.post(
        reverse("dashboard:member_role", args=[tenant.pk, bob.pk]), {"tenant_role": "admin"}, headers=HTMX
    ).content.decode()
    bob.refresh_from_db()
    assert bob.is_tenant_admin and 'data-username="bob"' in page
    page = client.post(reverse("dashboard:member_remove", args=[tenant.pk, bob.pk]), headers=HTMX).content.decode()
    bob.refresh_from_db()
    assert not bob.is_active and 'data-username="bob"' not in page
    assert set(AuditEntry.objects.values_list("action", flat=True)) == {"member.role", "member.remove"}


def test_the_last_admin_is_told_why_they_cannot_leave(client, tenant, tenant_admin):
    page = client.post(
        reverse("dashboard:member_role", args=[tenant.pk, tenant_admin.pk]), {"tenant_role": "member"}, headers=HTMX
    ).content.decode()
    assert 'id="team-error"' in page and "last admin of Acme" in page
    response = client.post(reverse("dashboard:member_remove", args=[tenant.pk, tenant_admin.pk]), follow=True)
    assert "last admin of Acme" in response.content.decode()
    tenant_admin.refresh_from_db()
    assert tenant_admin.is_active and tenant_admin.is_tenant_admin


def test_a_platform_admin_manages_any_tenants_team_from_its_page(client, tenant):
    client.force_login(UserFactory(role=User.Role.ADMIN, tenant=None))
    page = client.get(reverse("dashboard:tenant_detail", args=[tenant.pk])).content.decode()
    assert 'id="invite-form"' in page and 'id="grant-form"' in page
    response = client.post(reverse("dashboard:team_invitation_create", args=[tenant.pk]), {"tenant_role": "admin"})
    assert response.status_code == 200 and _link(response.content.decode())  # a plain post: a page for the link
    assert Invitation.objects.get().tenant_role == User.TenantRole.ADMIN


def test_admins_invite_operators_from_the_staff_page(client):
    client.force_login(UserFactory(username="root", role=User.Role.ADMIN, tenant=None))
    page = client.post(reverse("dashboard:staff"), {"role": "operator", "note": "Olga"}, headers=HTMX).content.decode()
    link = _link(page)
    client.logout()
    client.post(
        link.removeprefix("http://testserver"),
        {"username": "olga", "password": NEW_PASSWORD, "password_again": NEW_PASSWORD},
    )
    olga = User.objects.get(username="olga")
    assert (olga.role, olga.tenant, olga.is_staff) == (User.Role.OPERATOR, None, False)
    bad = UserFactory(role=User.Role.ADMIN, tenant=None)
    client.force_login(bad)
    page = client.post(reverse("dashboard:staff"), {"role": "tenant_member"}, headers=HTMX).content.decode()
    assert "Select a valid choice" in page
