"""The product settings plus the baseline app and its URL; used only by ``bench/accept.py``."""

from project.settings import *  # noqa: F403
from project.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench.baseline_app.apps.BaselineAppConfig"]
ROOT_URLCONF = "bench.baseline_app.urls"
