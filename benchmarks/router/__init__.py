"""`loraplex bench router`: the affinity router against Ray Serve's routers on a real local Ray."""
