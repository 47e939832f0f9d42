"""HTTP ingress (OpenAI-compatible) and adapter-affinity replica selection."""
