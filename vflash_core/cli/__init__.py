"""The `vflash` command line."""
