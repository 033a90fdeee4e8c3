"""Test-only ComfyUI stand-ins; see README.md. Importing this package does not install them (harness.py does)."""
