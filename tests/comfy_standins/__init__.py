"""Test helpers that load the node pack over its headless host; see README.md."""
