"""Settings for the test run: the service's own settings, read after the test environment is set.

Before anything reads the environment: keep every socket on loopback and keep the embedded
defaults' files (secret key, filesystem broker) out of the checkout's var/.
"""

import os
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("NEREUS_VAR_DIR", tempfile.mkdtemp(prefix="nereus-test-var-"))
os.environ.pop("RAY_ADDRESS", None)

from webapp.settings import *  # noqa: F403
from webapp.settings import DATABASES

if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file, not Django's in-memory default, so that child processes can share the test database.
    DATABASES["default"]["TEST"] = {
        "NAME": os.path.join(os.environ["NEREUS_VAR_DIR"], "test.sqlite3")
    }
else:
    # Connections opened by database_sync_to_async threads must not outlive a test, or the test
    # database cannot be dropped at the end of the run.
    DATABASES["default"]["CONN_MAX_AGE"] = 0

# Django's default hasher takes about 0.4 s a password here, by design; the tests make hundreds of
# users. The documented way to speed test runs up: a fast hasher for the users tests make in this
# process (the service's processes started by tests keep the real settings and their own users).
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
