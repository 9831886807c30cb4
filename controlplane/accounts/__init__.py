"""Console accounts: users and their roles, server-side sessions, API token revocation, the sign-in throttle.

Every change an operator makes here (from the console or the CLI) writes an ``audit_log`` row.
"""
