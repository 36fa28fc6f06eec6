"""Local multi-node Ray cluster on one machine (head + draft-pool node + target-pool node); see ``local``."""
