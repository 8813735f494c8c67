"""Topics, event schemas and the Faust budget ledger."""
