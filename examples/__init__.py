"""Examples of bringing your own model (README.md "Bring your own model")."""
