"""Command-line edge: Hydra apps that turn configs into specs and call the library."""
