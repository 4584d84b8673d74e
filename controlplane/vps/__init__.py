"""Provider accounts and their capacity reservations, reservation grants (spec 001), VM instances
on those reservations, and the metering ledger. Its tables are written only by vps/queries.py."""
