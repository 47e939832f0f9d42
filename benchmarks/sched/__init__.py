"""`loraplex bench sched`: seed 004's experiment (Chameleon) against S-LoRA."""
