"""The embedded default's Celery broker: kombu's filesystem transport, with messages that appear
whole. kombu writes a message file in place, and a consumer in another process may move and read
it before the first byte is written (an empty payload, which stops the worker); a process killed
mid-write leaves such a file behind for every later worker. Here a message is written under a
name the consumers skip and renamed into the queue once complete (atomic on one filesystem), and a
file that still cannot be read is dropped with a warning instead of stopping the worker."""

from __future__ import annotations

import logging
import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

logger = logging.getLogger(__name__)

ALIAS = "nereusfs"


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue):
        while True:  # ends with the queue's next readable message, or kombu's Empty
            try:
                return super()._get(queue)
            except ValueError:
                logger.warning("dropped an unreadable message of queue %s", queue)


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES.setdefault(ALIAS, "webapp.broker:Transport")
