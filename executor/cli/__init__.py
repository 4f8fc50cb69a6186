"""The executor's verbs: `paratwin execute` and `paratwin bench` (Hydra composes, the launcher spawns)."""
