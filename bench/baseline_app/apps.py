from django.apps import AppConfig


class BaselineAppConfig(AppConfig):
    name = "bench.baseline_app"
    label = "bench_baseline"
    default_auto_field = "django.db.models.BigAutoField"
