"""Build-time numerics shared by the compiler and the oracle: rotations and codebooks."""
