"""Seeing and setting fair share (docs/OPERABILITY.md "Fair share"): the admin page, the
``tenant_share`` manage command, and the per-tenant gauges on /metrics under a pseudonymous
tenant label."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import Client

from conversion_jobs.models import ConversionOutbox, PageCheckpoint, TenantShare
from conversion_jobs.pseudonym import pseudonym
from conversion_jobs.services import fair
from tests.conftest import metrics_headers

CHANGELIST = "/admin/conversion_jobs/tenantshare/"


@pytest.fixture
def staff_client() -> Client:
    user = get_user_model().objects.create_user(
        "operator", password="pw-operator", is_staff=True, is_superuser=True
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def picture(make_job):
    """tenant-a: 3 units waiting (cost 5 each) and 1 running job with 3 pages done in the
    window; tenant-b: 1 page done in the window."""
    for _ in range(3):
        job = make_job(tenant="tenant-a", dispatch_cost=5)
        ConversionOutbox.objects.create(job=job, generation=1)
    running = make_job(state="running", tenant="tenant-a")
    done = make_job(state="running", tenant="tenant-b")
    for job, pages in ((running, 3), (done, 1)):
        for n in range(1, pages + 1):
            PageCheckpoint.objects.create(
                job=job,
                page_number=n,
                state="done",
                generation=1,
                artifact_key=f"pages/{job.id}/{n:05d}.g1.txt",
                artifact_sha256="a" * 64,
                artifact_size=1,
            )
    return running


@pytest.mark.django_db
def test_fairness__backlog_running_and_share_per_tenant(picture):
    rows = {r.tenant: r for r in fair.tenants_fairness()}
    a, b = rows["tenant-a"], rows["tenant-b"]
    assert (a.backlog_units, a.backlog_cost, a.running, a.pages_window) == (3, 15, 1, 3)
    assert (b.backlog_units, b.running, b.pages_window) == (0, 1, 1)
    assert a.page_share == pytest.approx(0.75) and b.page_share == pytest.approx(0.25)


@pytest.mark.django_db
def test_admin__lists_every_tenant_with_its_picture_and_sets_the_weight(picture, staff_client):
    page = staff_client.get(CHANGELIST).content.decode()
    assert "tenant-a" in page and "tenant-b" in page and "75.0%" in page
    response = staff_client.post(f"{CHANGELIST}tenant-a/change/", {"weight": 3, "running_cap": 2})
    assert response.status_code == 302, response.content[:500]
    share = TenantShare.objects.get(tenant="tenant-a")
    assert (share.weight, share.running_cap) == (3, 2)
    refused = staff_client.post(f"{CHANGELIST}tenant-a/change/", {"weight": 0})
    assert refused.status_code == 200  # the form's error, nothing saved
    assert TenantShare.objects.get(tenant="tenant-a").weight == 3


@pytest.mark.django_db
def test_tenant_share_command__sets_weight_and_cap_and_lists(picture):
    out = io.StringIO()
    call_command("tenant_share", "tenant-b", "--weight", "4", "--cap", "2", stdout=out)
    share = TenantShare.objects.get(tenant="tenant-b")
    assert (share.weight, share.running_cap) == (4, 2)
    assert "tenant-b\t4\t2\t" in out.getvalue()
    call_command("tenant_share", "tenant-b", "--no-cap", stdout=io.StringIO())
    assert TenantShare.objects.get(tenant="tenant-b").running_cap is None
    with pytest.raises(CommandError):
        call_command("tenant_share", "tenant-b", "--weight", "0", stdout=io.StringIO())
    with pytest.raises(CommandError):
        call_command("tenant_share", "--weight", "2", stdout=io.StringIO())
    listing = io.StringIO()
    call_command("tenant_share", stdout=listing)
    assert "tenant-a\t1\t-\t3\t15\t1\t3\t0.750" in listing.getvalue()


@pytest.mark.django_db
def test_metrics__per_tenant_gauges_carry_a_pseudonym_never_the_tenant(picture):
    text = Client().get("/metrics", headers=metrics_headers()).content.decode()
    label = pseudonym("tenant", "tenant-a")
    assert f'quire_tenant_backlog_units{{tenant="{label}"}} 3.0' in text
    assert f'quire_tenant_backlog_cost{{tenant="{label}"}} 15.0' in text
    assert f'quire_tenant_running{{tenant="{label}"}} 1.0' in text
    assert f'quire_tenant_page_share_ratio{{tenant="{label}"}} 0.75' in text
    assert "tenant-a" not in text and "tenant-b" not in text
