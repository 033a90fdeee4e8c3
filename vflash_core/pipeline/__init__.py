"""The pipeline: one request path from a prompt and media to an MP4, its options, validation and memory plan."""
