"""The glue behind the make targets (the shell scripts here), and the Python tools they run, importable as
`scripts.*` from the repository root (the tests import them so; none of it ships in the wheel)."""
