"""ASGI entry point: HTTP through Django, websockets through Channels (session or bearer token),
both behind the caps on what a client may send (``webapp/limits.py``)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()

from webapp import startup  # noqa: E402

startup.check_or_exit("web server")

from channels.routing import ProtocolTypeRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from webapp.jobs.routing import websocket_urlpatterns  # noqa: E402
from webapp.jobs.ws_auth import websocket_application  # noqa: E402
from webapp.limits import BodyLimitMiddleware  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": BodyLimitMiddleware(django_asgi_app),
        "websocket": BodyLimitMiddleware(
            AllowedHostsOriginValidator(websocket_application(websocket_urlpatterns))
        ),
    }
)
