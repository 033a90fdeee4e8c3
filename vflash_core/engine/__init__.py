"""The engine: the model's ops and one block body, fused kernels, attention, the denoising loop, sessions."""
