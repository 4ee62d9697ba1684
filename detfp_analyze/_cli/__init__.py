"""Command implementations of ``detfp-analyze``, one module per command.

Only this subpackage prints, writes files or chooses exit codes; everything it calls
is a pure library function that raises typed errors (``detfp_analyze.errors``).
"""
