"""Helpers shared by the test folders (importable as `kit` from every test: pytest puts tests/ on sys.path)."""
