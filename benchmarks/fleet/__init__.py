"""`loraplex bench fleet`: the routers at fleet scale in the simulator, and the simulator against a real run."""
