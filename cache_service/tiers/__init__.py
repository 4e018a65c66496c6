"""KV cache tiers behind one interface (`base.Tier`), chosen by URL scheme (`factory.open_tier`)."""
