"""`make docs` (`python -m scripts.docs.reference`) and what the docs are checked against (`facts`)."""
