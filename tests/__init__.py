"""mqabstract tests: unit tests of the portable layer and backend-specific tests."""
