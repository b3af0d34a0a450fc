from django.urls import path

from bench.baseline_app import views
from project.urls import urlpatterns as product_urlpatterns

urlpatterns = [path("bench/baseline", views.insert_one), *product_urlpatterns]
