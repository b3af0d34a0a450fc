from django.apps import AppConfig


class ConversionJobsConfig(AppConfig):
    name = "conversion_jobs"
    verbose_name = "Conversion jobs"
    default_auto_field = "django.db.models.BigAutoField"
