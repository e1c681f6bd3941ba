"""Forms of the team pages: invitations, team roles and accepting an invitation. They check shapes;
who may do what, and the last-admin rule, are the services' (controlplane.accounts.services)."""

from django import forms

from controlplane.accounts.models import User

STAFF_ROLES = [(User.Role.OPERATOR, User.Role.OPERATOR.label), (User.Role.ADMIN, User.Role.ADMIN.label)]


class TeamInvitationForm(forms.Form):
    tenant_role = forms.ChoiceField(
        choices=User.TenantRole.choices,
        initial=User.TenantRole.MEMBER,
        label="Role",
        help_text="Tenant admins invite, set roles and remove members.",
    )
    note = forms.CharField(
        max_length=100,
        required=False,
        label="For",
        help_text="Optional: who it is for, so you can tell invitations apart.",
    )


class StaffInvitationForm(forms.Form):
    role = forms.ChoiceField(
        choices=STAFF_ROLES,
        initial=User.Role.OPERATOR,
        help_text="Operators run the fleet and catalog; admins also manage tenants and reports.",
    )
    note = forms.CharField(
        max_length=100,
        required=False,
        label="For",
        help_text="Optional: who it is for, so you can tell invitations apart.",
    )


class MemberRoleForm(forms.Form):
    tenant_role = forms.ChoiceField(choices=User.TenantRole.choices, label="Role")


class InvitationAcceptForm(forms.Form):
    username = forms.CharField(max_length=150, help_text="Letters, digits and @/./+/-/_ only.")
    email = forms.EmailField(required=False, help_text="Optional.")
    password = forms.CharField(widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}))
    password_again = forms.CharField(
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}), label="Password again"
    )

    def clean_username(self) -> str:
        return self.cleaned_data["username"].strip()

    def clean(self):
        data = super().clean()
        if data.get("password") and data.get("password_again") and data["password"] != data["password_again"]:
            self.add_error("password_again", "The two passwords differ.")
        return data
