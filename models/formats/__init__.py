"""Model files and loading: the GGUF reader, weight sources, weight maps, the pack cache, the hub."""
