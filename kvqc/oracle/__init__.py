"""The float64 reference every generated module is checked against. It reads the scheme and its layout, never the
templates."""
