"""Communication, one module per parallel axis (tp, ep, pp) over `group.Group`; no globals."""
