"""Membership changes end the tokens they take the grounds from.

A token acts at the lower of its own role and its creator's current role (``selectors.role_of``),
so a removed or demoted member's tokens are disarmed at once. That alone would let them work
again, at full power, the day the person is added back or promoted, months later, with a secret
that may have leaked into an old CI log meanwhile. So a removal revokes every token the member
made in the project, and a demotion every one of their tokens above the new role. Signals, not a
service, because memberships also change on the admin site and through cascades.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import post_delete, pre_save
from django.dispatch import receiver
from django.utils import timezone

from webapp.projects.models import ROLE_RANKS, ApiToken, Membership, Role


def _revoke(*, user_id: int, project_id: int, above: Role | None = None) -> int:
    """Revoke the user's active tokens in the project (only those above ``above`` if given)."""
    tokens = ApiToken.objects.filter(
        user_id=user_id, project_id=project_id, revoked_at__isnull=True
    )
    if above is not None:
        tokens = tokens.filter(role__in=[r for r, rank in ROLE_RANKS.items() if rank > above.rank])
    return tokens.update(revoked_at=timezone.now())


@receiver(post_delete, sender=Membership, dispatch_uid="projects.revoke_tokens_on_removal")
def revoke_tokens_on_removal(sender, instance: Membership, **kwargs) -> None:
    _revoke(user_id=instance.user_id, project_id=instance.project_id)


@receiver(pre_save, sender=Membership, dispatch_uid="projects.revoke_tokens_on_demotion")
def revoke_tokens_on_demotion(sender, instance: Membership, raw: bool = False, **kwargs) -> None:
    if raw or instance.pk is None:
        return  # a fixture being loaded, or a new member (who has no tokens here yet)
    with transaction.atomic():
        # Locked as ``services.token_create`` locks it: a token being made now is stored before
        # this reads the tokens, and so is revoked with the others.
        before = (
            Membership.objects.select_for_update()
            .filter(pk=instance.pk)
            .values_list("role", flat=True)
            .first()
        )
        if before is None:
            return
        new = Role(instance.role)
        if new.rank < Role(before).rank:
            _revoke(user_id=instance.user_id, project_id=instance.project_id, above=new)
