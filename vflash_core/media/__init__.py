"""Media: the official encoders and VAEs, references on H3's rates and sizes, MP4 delivery."""
