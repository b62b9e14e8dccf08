"""The submit form of the job list page."""

from django import forms

from runtime.jobs.spec import SftJobSpec
from webapp.projects.models import Role
from webapp.projects.selectors import projects_visible_to

_DEFAULT = SftJobSpec()


class JobSubmitForm(forms.Form):
    project = forms.ModelChoiceField(
        queryset=None,
        required=False,
        empty_label="my personal project",
        help_text="Projects where you may submit (operator role or above).",
    )
    name = forms.CharField(max_length=200, initial="sft-demo")
    num_slots = forms.IntegerField(
        min_value=1,
        max_value=8,
        initial=_DEFAULT.num_slots,
        help_text="CPU slots stand in for GPUs on this machine.",
    )
    num_steps = forms.IntegerField(min_value=1, max_value=100_000, initial=_DEFAULT.num_steps)
    seed = forms.IntegerField(min_value=0, max_value=2**31 - 1, initial=_DEFAULT.seed)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = projects_visible_to(user, min_role=Role.OPERATOR)

    def spec(self) -> dict:
        data = self.cleaned_data
        return {
            "num_slots": data["num_slots"],
            "num_steps": data["num_steps"],
            "seed": data["seed"],
        }
