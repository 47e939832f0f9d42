"""`loraplex bench ...` workloads: each module measures ratios side by side in one run."""
