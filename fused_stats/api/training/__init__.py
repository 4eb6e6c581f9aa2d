"""Statistics from the user's own training steps: observe, the monitor log, step logging for the callbacks."""
