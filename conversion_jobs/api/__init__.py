"""The REST API (DRF): views, serializers, bearer JWT auth, RFC 9457 problems."""
