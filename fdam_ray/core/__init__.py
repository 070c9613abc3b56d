"""What every layer above shares: the state vectors (declared once), a model bound to flat buffers, the schedule."""
