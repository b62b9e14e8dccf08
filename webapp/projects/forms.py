"""The project page's form: a new API token."""

from __future__ import annotations

from django import forms

from webapp.projects.models import Role
from webapp.projects.services import MAX_TOKEN_DAYS
from webapp.validators import NoControlCharacters


class TokenForm(forms.Form):
    """A token for a CI pipeline: a name to know it by, and the role it acts with (never above
    its creator's current role, whatever is chosen here)."""

    name = forms.CharField(
        max_length=200,
        help_text="What uses it, e.g. the pipeline's name.",
        validators=[NoControlCharacters()],
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.OPERATOR)
    expires_in_days = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=MAX_TOKEN_DAYS,
        label="Expires in (days)",
        help_text="Empty: until revoked.",
    )
