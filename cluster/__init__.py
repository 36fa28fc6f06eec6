"""Local multi-node Ray cluster on one machine (head + draft-pool node + target-pool node).

``local``: up, down, address (and re-exports of the rest); ``state``: the state file;
``processes``: starting, finding and stopping node processes; ``status``: what is running.
"""
