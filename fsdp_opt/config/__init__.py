"""Layer 1, flags: the choices they accept, one dataclass per concern, and parsing into a `Config`."""
