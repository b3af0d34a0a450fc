from django.db import models


class BaselineRow(models.Model):
    """One row per baseline request: the cheapest durable write Django can do."""

    tenant = models.CharField(max_length=64)
    size = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "bench_baseline_row"

    def __str__(self) -> str:
        return f"baseline row {self.id}"
