"""Teams and invitations: who may invite whom, an invitation link used once and only before it
expires, roles within a tenant, removing members, and a team that always keeps an admin."""

import threading
from datetime import timedelta

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connections
from django.utils import timezone

from controlplane.accounts.models import Invitation, User
from controlplane.accounts.selectors import invitation_get_by_token, invitations_open, team_members
from controlplane.accounts.services import (
    invitation_accept,
    invitation_create,
    invitation_revoke,
    may_manage_team,
    member_remove,
    member_set_tenant_role,
)
from controlplane.audit.models import AuditEntry
from tests.controlplane.factories import TenantFactory, UserFactory

pytestmark = pytest.mark.django_db

NEW_PASSWORD = "a new Pa55word for tests"


@pytest.fixture
def tenant():
    return TenantFactory(name="Acme")


@pytest.fixture
def tenant_admin(tenant):
    return UserFactory(username="ada", tenant=tenant, tenant_role=User.TenantRole.ADMIN)


@pytest.fixture
def platform_admin():
    return UserFactory(username="root", role=User.Role.ADMIN, tenant=None)


def _invite(by, tenant, **kwargs):
    return invitation_create(created_by=by, role=User.Role.TENANT_MEMBER, tenant=tenant, **kwargs)


def test_an_invited_person_joins_the_tenant_with_the_role_chosen(tenant, tenant_admin):
    created = _invite(tenant_admin, tenant, tenant_role=User.TenantRole.ADMIN, note="Grace")
    assert created.invitation.token_hash != created.token and created.token not in str(created.invitation.__dict__)
    user = invitation_accept(token=created.token, username="grace", password=NEW_PASSWORD, email="g@example.com")
    assert (user.role, user.tenant, user.tenant_role, user.email) == (
        User.Role.TENANT_MEMBER,
        tenant,
        User.TenantRole.ADMIN,
        "g@example.com",
    )
    assert user.check_password(NEW_PASSWORD) and not user.is_staff
    created.invitation.refresh_from_db()
    assert created.invitation.accepted_by == user and created.invitation.accepted_at is not None
    actions = list(AuditEntry.objects.order_by("pk").values_list("action", "actor_label"))
    assert actions == [("invitation.create", "ada"), ("invitation.accept", "grace")]


def test_an_invitation_works_once(tenant, tenant_admin):
    created = _invite(tenant_admin, tenant)
    invitation_accept(token=created.token, username="first", password=NEW_PASSWORD)
    with pytest.raises(ValidationError, match="already been used"):
        invitation_accept(token=created.token, username="second", password=NEW_PASSWORD)
    assert not User.objects.filter(username="second").exists()


@pytest.mark.django_db(transaction=True)
def test_two_people_racing_with_one_link_make_one_login(require_postgres):
    tenant = TenantFactory()
    created = _invite(UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN), tenant)
    start = threading.Barrier(6)
    outcomes, lock = [], threading.Lock()

    def accept(number):
        try:
            start.wait()
            try:
                invitation_accept(token=created.token, username=f"racer{number}", password=NEW_PASSWORD)
                outcome = "joined"
            except ValidationError:
                outcome = "refused"
            with lock:
                outcomes.append(outcome)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=accept, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["joined"] + ["refused"] * 5
    assert User.objects.filter(username__startswith="racer").count() == 1


def test_an_expired_or_withdrawn_invitation_is_refused(tenant, tenant_admin):
    expired = _invite(tenant_admin, tenant, lifetime=timedelta(seconds=-1))
    with pytest.raises(ValidationError, match="expired"):
        invitation_accept(token=expired.token, username="late", password=NEW_PASSWORD)
    withdrawn = _invite(tenant_admin, tenant)
    invitation_revoke(invitation=withdrawn.invitation, actor=tenant_admin)
    with pytest.raises(ValidationError, match="withdrawn"):
        invitation_accept(token=withdrawn.token, username="late", password=NEW_PASSWORD)
    with pytest.raises(ValidationError, match="not valid"):
        invitation_accept(token="made-up", username="late", password=NEW_PASSWORD)
    assert not User.objects.filter(username="late").exists()
    assert list(invitations_open(tenant=tenant)) == []


def test_an_invitation_to_a_deactivated_tenant_is_refused(tenant, tenant_admin):
    created = _invite(tenant_admin, tenant)
    tenant.is_active = False
    tenant.save()
    with pytest.raises(ValidationError, match="deactivated"):
        invitation_accept(token=created.token, username="nobody", password=NEW_PASSWORD)


@pytest.mark.parametrize(
    ("username", "password", "field"),
    [
        ("ada", NEW_PASSWORD, "username"),  # taken
        ("ADA", NEW_PASSWORD, "username"),  # taken, whatever the case
        ("newbie", "123", "password"),  # too short and common
        ("bad name!", NEW_PASSWORD, "username"),
    ],
)
def test_a_bad_login_leaves_the_invitation_usable(tenant, tenant_admin, username, password, field):
    created = _invite(tenant_admin, tenant)
    with pytest.raises(ValidationError) as caught:
        invitation_accept(token=created.token, username=username, password=password)
    assert field in caught.value.message_dict
    user = invitation_accept(token=created.token, username="newbie2", password=NEW_PASSWORD)
    assert user.tenant == tenant


def test_who_may_invite_whom(tenant, tenant_admin, platform_admin):
    member = UserFactory(tenant=tenant)
    operator = UserFactory(role=User.Role.OPERATOR, tenant=None)
    other_admin = UserFactory(tenant=TenantFactory(), tenant_role=User.TenantRole.ADMIN)
    for outsider in (member, operator, other_admin):
        with pytest.raises(PermissionDenied):
            _invite(outsider, tenant)
    for not_admin in (tenant_admin, operator):
        with pytest.raises(PermissionDenied):
            invitation_create(created_by=not_admin, role=User.Role.OPERATOR)
    assert _invite(platform_admin, tenant).invitation.tenant == tenant
    staff = invitation_create(created_by=platform_admin, role=User.Role.OPERATOR, note="Olga")
    user = invitation_accept(token=staff.token, username="olga", password=NEW_PASSWORD)
    assert (user.role, user.tenant) == (User.Role.OPERATOR, None)
    with pytest.raises(ValidationError, match="belong to no tenant"):
        invitation_create(created_by=platform_admin, role=User.Role.ADMIN, tenant=tenant)
    with pytest.raises(ValidationError, match="Name the tenant"):
        invitation_create(created_by=platform_admin, role=User.Role.TENANT_MEMBER)
    assert Invitation.objects.count() == 2


def test_may_manage_team(tenant, tenant_admin, platform_admin):
    assert may_manage_team(user=tenant_admin, tenant=tenant) and may_manage_team(user=platform_admin, tenant=tenant)
    assert not may_manage_team(user=UserFactory(tenant=tenant), tenant=tenant)
    assert not may_manage_team(user=tenant_admin, tenant=TenantFactory())
    assert not may_manage_team(user=UserFactory(role=User.Role.OPERATOR, tenant=None), tenant=tenant)


def test_invitation_tokens_are_found_by_hash_only(tenant, tenant_admin):
    created = _invite(tenant_admin, tenant)
    assert invitation_get_by_token(token=created.token) == created.invitation
    assert invitation_get_by_token(token=created.invitation.token_hash) is None


def test_roles_change_and_are_audited(tenant, tenant_admin):
    member = UserFactory(username="bea", tenant=tenant)
    member_set_tenant_role(member=member, tenant_role=User.TenantRole.ADMIN, actor=tenant_admin)
    member.refresh_from_db()
    assert member.is_tenant_admin
    entry = AuditEntry.objects.get(action=AuditEntry.Action.MEMBER_ROLE)
    assert (entry.actor_label, entry.target_label, entry.describe()) == (
        "ada",
        "bea (Acme)",
        "role: Member → Tenant admin",
    )
    with pytest.raises(ValidationError, match="Unknown role"):
        member_set_tenant_role(member=member, tenant_role="owner", actor=tenant_admin)


def test_a_member_who_is_not_an_admin_cannot_change_the_team(tenant, tenant_admin):
    member = UserFactory(tenant=tenant)
    with pytest.raises(PermissionDenied):
        member_set_tenant_role(member=member, tenant_role=User.TenantRole.ADMIN, actor=member)
    with pytest.raises(PermissionDenied):
        member_remove(member=tenant_admin, actor=member)
    with pytest.raises(PermissionDenied):
        member_remove(member=member, actor=UserFactory(tenant=TenantFactory(), tenant_role=User.TenantRole.ADMIN))
    tenant_admin.refresh_from_db()
    assert tenant_admin.is_active and tenant_admin.is_tenant_admin


def test_the_last_admin_can_be_neither_demoted_nor_removed(tenant, tenant_admin, platform_admin):
    with pytest.raises(ValidationError, match="last admin of Acme"):
        member_set_tenant_role(member=tenant_admin, tenant_role=User.TenantRole.MEMBER, actor=tenant_admin)
    with pytest.raises(ValidationError, match="last admin"):
        member_remove(member=tenant_admin, actor=platform_admin)
    # A deactivated admin does not count as another admin.
    UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN, is_active=False)
    with pytest.raises(ValidationError, match="last admin"):
        member_remove(member=tenant_admin, actor=tenant_admin)
    second = UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN)
    member_remove(member=tenant_admin, actor=second)
    tenant_admin.refresh_from_db()
    assert not tenant_admin.is_active and list(team_members(tenant=tenant)) == [second]
    assert AuditEntry.objects.filter(action=AuditEntry.Action.MEMBER_REMOVE, actor_label=second.username).exists()


@pytest.mark.django_db(transaction=True)
def test_two_admins_demoting_each_other_at_once_leave_one_admin(require_postgres):
    tenant = TenantFactory()
    first, second = (UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN) for _ in range(2))
    start = threading.Barrier(2)
    refusals = []

    def demote(member, actor):
        try:
            start.wait()
            try:
                member_set_tenant_role(member=member, tenant_role=User.TenantRole.MEMBER, actor=actor)
            except (ValidationError, PermissionDenied) as exc:
                refusals.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=demote, args=(first, second)),
        threading.Thread(target=demote, args=(second, first)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(refusals) == 1
    assert User.objects.filter(tenant=tenant, tenant_role=User.TenantRole.ADMIN).count() == 1


def test_removed_members_cannot_sign_in(client, tenant, tenant_admin):
    from tests.controlplane.factories import PASSWORD

    member = UserFactory(tenant=tenant)
    client.force_login(member)
    member_remove(member=member, actor=tenant_admin)
    assert client.get("/keys/").status_code == 302  # the open session no longer counts
    response = client.post("/accounts/login/", {"username": member.username, "password": PASSWORD})
    assert response.status_code == 200  # the form again: a success would redirect
    assert client.get("/keys/").status_code == 302


def test_operators_have_no_team_role(platform_admin):
    with pytest.raises(ValidationError, match="Only members of a tenant"):
        member_remove(member=UserFactory(role=User.Role.OPERATOR, tenant=None), actor=platform_admin)


def test_expired_invitations_are_not_open(tenant, tenant_admin):
    _invite(tenant_admin, tenant)
    later = timezone.now() + timedelta(days=8)
    assert invitations_open(tenant=tenant).count() == 1 and invitations_open(tenant=tenant, now=later).count() == 0
