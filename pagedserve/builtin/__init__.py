"""Models that come with the package: the tiny one it makes locally, and the config.json facts of
well-known ones (for --load-format dummy)."""
