"""The web image (deploy/web/Dockerfile) carries every package of this project that the web,
the workers, beat and the wake server import: a package left out is an image that does not start."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_IMPORTS = """
import sys
import django
django.setup()
import config.urls, config.celery  # the web's routes and every task the workers run
from django.core.management import get_commands, load_command_class
for name, app in get_commands().items():
    if not app.startswith("django"):
        load_command_class(app, name)  # wake_server, migrate, the ops commands
print(" ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_the_web_image_copies_every_package_the_server_imports():
    imported = subprocess.run(
        [sys.executable, "-c", _IMPORTS], cwd=ROOT, check=True, capture_output=True, text=True,
        env={**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"},
    ).stdout.split()  # fmt: skip
    ours = {name for name in imported if (ROOT / name / "__init__.py").is_file()}
    dockerfile = (ROOT / "deploy/web/Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, flags=re.M))
    assert {"config", "marketplace", "provisioning"} <= ours  # the check sees the project
    assert ours - copied == set()
