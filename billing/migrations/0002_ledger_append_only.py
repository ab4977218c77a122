"""The ledger is append-only in the database itself: UPDATE and DELETE raise, whatever the code
does (TRUNCATE, used only by test flushes, fires no row trigger)."""

from django.db import migrations

SQL = """
CREATE FUNCTION billing_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'billing_ledgerentry is append-only: % refused', TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;
CREATE TRIGGER ledger_append_only
    BEFORE UPDATE OR DELETE ON billing_ledgerentry
    FOR EACH ROW EXECUTE FUNCTION billing_ledger_append_only();
"""

REVERSE_SQL = """
DROP TRIGGER ledger_append_only ON billing_ledgerentry;
DROP FUNCTION billing_ledger_append_only();
"""


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]

    operations = [migrations.RunSQL(SQL, REVERSE_SQL)]
