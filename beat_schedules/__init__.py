"""The declarative beat schedule, installed into django-celery-beat's DatabaseScheduler."""
