"""A Python environment as data: the interpreter's prefix and owner, RECORDs, installed distributions,
wheels, hashing, drift, verification, uv's plan."""
