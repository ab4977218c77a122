"""Billing: metering, rating, the append-only ledger, invoices, Stripe, provider payouts."""
