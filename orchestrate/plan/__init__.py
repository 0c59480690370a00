"""Plan (pure, no I/O): config + hosts + probe facts -> what every node gets."""
