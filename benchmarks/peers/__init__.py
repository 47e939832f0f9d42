"""The systems we are measured against, modelled from their own source: S-LoRA (and Chameleon on it), Ray Serve's routers."""
