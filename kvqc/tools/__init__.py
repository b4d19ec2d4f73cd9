"""Tools around generated modules: bench (speed), tune (launch tables), eval and quality (model and cache error)."""
