from django.urls import path

from conversion_jobs.api import erasures, views, webhooks

urlpatterns = [
    path("jobs", views.JobCollectionView.as_view(), name="jobs"),
    path("jobs/<uuid:job_id>", views.waitable(views.JobDetailView), name="job"),
    path("jobs/<uuid:job_id>/cancel", views.JobCancelView.as_view(), name="job-cancel"),
    path("jobs/<uuid:job_id>/retry", views.JobRetryView.as_view(), name="job-retry"),
    path("jobs/<uuid:job_id>/result", views.JobResultView.as_view(), name="job-result"),
    path("jobs/<uuid:job_id>/pages", views.JobPagesView.as_view(), name="job-pages"),
    path("jobs/<uuid:job_id>/pages/<int:page>", views.JobPageView.as_view(), name="job-page"),
    path("jobs/<uuid:job_id>/events", views.waitable(views.JobEventsView), name="job-events"),
    path("capabilities", views.CapabilitiesView.as_view(), name="capabilities"),
    path("erasures", erasures.ErasureCollectionView.as_view(), name="erasures"),
    path("webhooks", webhooks.WebhookCollectionView.as_view(), name="webhooks"),
    path("webhooks/<uuid:endpoint_id>", webhooks.WebhookDetailView.as_view(), name="webhook"),
    path(
        "webhooks/<uuid:endpoint_id>/rotate-secret",
        webhooks.WebhookRotateView.as_view(),
        name="webhook-rotate",
    ),
    path(
        "webhooks/<uuid:endpoint_id>/recover",
        webhooks.WebhookRecoverView.as_view(),
        name="webhook-recover",
    ),
    path(
        "webhooks/<uuid:endpoint_id>/messages",
        webhooks.WebhookMessagesView.as_view(),
        name="webhook-messages",
    ),
    path(
        "webhooks/<uuid:endpoint_id>/messages/<str:message_id>/attempts",
        webhooks.WebhookAttemptsView.as_view(),
        name="webhook-attempts",
    ),
    path(
        "webhooks/<uuid:endpoint_id>/messages/<str:message_id>/replay",
        webhooks.WebhookReplayView.as_view(),
        name="webhook-replay",
    ),
]
