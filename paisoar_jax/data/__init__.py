"""The input pipeline: token sources, the grain pipeline and device prefetch."""
