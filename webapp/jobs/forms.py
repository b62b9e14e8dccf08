"""The submit form of the job list page."""

from django import forms

from runtime.jobs.spec import SftJobSpec

_DEFAULT = SftJobSpec()


class JobSubmitForm(forms.Form):
    name = forms.CharField(max_length=200, initial="sft-demo")
    num_slots = forms.IntegerField(
        min_value=1,
        max_value=8,
        initial=_DEFAULT.num_slots,
        help_text="CPU slots stand in for GPUs on this machine.",
    )
    num_steps = forms.IntegerField(min_value=1, max_value=100_000, initial=_DEFAULT.num_steps)
    seed = forms.IntegerField(min_value=0, max_value=2**31 - 1, initial=_DEFAULT.seed)

    def spec(self) -> dict:
        data = self.cleaned_data
        return {
            "num_slots": data["num_slots"],
            "num_steps": data["num_steps"],
            "seed": data["seed"],
        }
