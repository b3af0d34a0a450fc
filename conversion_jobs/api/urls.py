from django.urls import path

from conversion_jobs.api import erasures, views, webhooks

_JOB = "jobs/<uuid:job_id>"
_WEBHOOK = "webhooks/<uuid:endpoint_id>"
_MESSAGE = f"{_WEBHOOK}/messages/<str:message_id>"

#: (route, view, name) of every API endpoint.
_ROUTES = (
    ("jobs", views.JobCollectionView.as_view(), "jobs"),
    (_JOB, views.waitable(views.JobDetailView), "job"),
    (f"{_JOB}/cancel", views.JobCancelView.as_view(), "job-cancel"),
    (f"{_JOB}/retry", views.JobRetryView.as_view(), "job-retry"),
    (f"{_JOB}/result", views.JobResultView.as_view(), "job-result"),
    (f"{_JOB}/pages", views.JobPagesView.as_view(), "job-pages"),
    (f"{_JOB}/pages/<int:page>", views.JobPageView.as_view(), "job-page"),
    (f"{_JOB}/events", views.waitable(views.JobEventsView), "job-events"),
    ("capabilities", views.CapabilitiesView.as_view(), "capabilities"),
    ("erasures", erasures.ErasureCollectionView.as_view(), "erasures"),
    ("webhooks", webhooks.WebhookCollectionView.as_view(), "webhooks"),
    (_WEBHOOK, webhooks.WebhookDetailView.as_view(), "webhook"),
    (f"{_WEBHOOK}/rotate-secret", webhooks.WebhookRotateView.as_view(), "webhook-rotate"),
    (f"{_WEBHOOK}/recover", webhooks.WebhookRecoverView.as_view(), "webhook-recover"),
    (f"{_WEBHOOK}/messages", webhooks.WebhookMessagesView.as_view(), "webhook-messages"),
    (f"{_MESSAGE}/attempts", webhooks.WebhookAttemptsView.as_view(), "webhook-attempts"),
    (f"{_MESSAGE}/replay", webhooks.WebhookReplayView.as_view(), "webhook-replay"),
)

urlpatterns = [path(route, view, name=name) for route, view, name in _ROUTES]
