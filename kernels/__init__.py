"""Vflash Triton kernels (installed and imported as `vflash_kernels`).

Each op sits beside its PyTorch reference with the identical BF16 rounding contract and a parity test.
"""
