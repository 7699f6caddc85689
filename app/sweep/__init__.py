"""`app bench`: the scaling sweep (its configurations, the command, results tables and plots)."""
