"""One module per parallel strategy; each reads next to the serial layer it splits."""
