from django.urls import path

from billing.api import views

urlpatterns = [
    path("account/", views.AccountView.as_view(), name="billing-account"),
    path("budgets/", views.BudgetView.as_view(), name="billing-budgets"),
    path("ledger/", views.LedgerListView.as_view(), name="billing-ledger"),
    path("earnings/", views.EarningsView.as_view(), name="billing-earnings"),
    path("notices/", views.NoticeListView.as_view(), name="billing-notices"),
    path("topups/", views.TopUpListCreateView.as_view(), name="billing-topups"),
    path("invoices/", views.InvoiceListView.as_view(), name="billing-invoices"),
    path(
        "invoices/<int:invoice_id>/",
        views.InvoiceDetailView.as_view(),
        name="billing-invoice-detail",
    ),
    path(
        "invoices/<int:invoice_id>/print/",
        views.InvoicePrintView.as_view(),
        name="billing-invoice-print",
    ),
    path(
        "rentals/<uuid:rental_id>/telemetry/",
        views.RentalTelemetryView.as_view(),
        name="billing-rental-telemetry",
    ),
    path(
        "rentals/<uuid:rental_id>/gpu-series/",
        views.RentalGpuSeriesView.as_view(),
        name="billing-rental-gpu-series",
    ),
    path(
        "rentals/<uuid:rental_id>/usage/",
        views.RentalUsageView.as_view(),
        name="billing-rental-usage",
    ),
]
