"""Weights: official files read, prepared, compiled once into packed blocks and AdaLN tables; loading a compile."""
