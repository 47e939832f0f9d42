"""Composition: configuration, the Serve app builder and the `loraplex` command line."""
