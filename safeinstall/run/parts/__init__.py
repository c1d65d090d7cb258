"""What a run is made of: its options, survey, preflight, ``Run`` value, units and result."""
