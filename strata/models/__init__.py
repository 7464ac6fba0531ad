"""Models by GGUF architecture: config, modules and forward (strata.load builds them)."""
