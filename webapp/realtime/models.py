"""Tables of the database-backed channel layer (used only when REDIS_URL is unset)."""

from django.db import models


class ChannelMessage(models.Model):
    """One message waiting on one channel until a receiver claims it or it expires."""

    channel = models.CharField(max_length=100, db_index=True)
    body = models.TextField(help_text="The message as JSON.")
    expires = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.channel}#{self.pk}"


class GroupMembership(models.Model):
    """A channel's membership of a group; renewed by group_add, dropped when it expires."""

    group = models.CharField(max_length=100, db_index=True)
    channel = models.CharField(max_length=100)
    expires = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["group", "channel"], name="realtime_group_channel_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.group} <- {self.channel}"
