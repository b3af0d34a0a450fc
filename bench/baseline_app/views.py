"""The baseline: read the (same) request body, insert one row in autocommit, answer JSON."""

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from bench.baseline_app.models import BaselineRow


@csrf_exempt
def insert_one(request: HttpRequest) -> JsonResponse:
    # Reading the body keeps the HTTP work equal to the real endpoint's (and the keep-alive
    # connection clean); it is not parsed.
    size = len(request.body)
    row = BaselineRow.objects.create(tenant="bench", size=size)
    return JsonResponse({"id": row.id, "size": size}, status=201)
