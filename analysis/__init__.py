"""`python -m analysis.report PATH`: every result.json below PATH -> tables and CSV."""
