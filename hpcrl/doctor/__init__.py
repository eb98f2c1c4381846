"""hpcrl doctor: what a node offers a run (checks.py), as a table (command.py)."""
