"""The runs, in four rooms, each importing only from itself or a room below it
(``tests/test_layers.py``): ``commands`` -> ``steps`` -> ``back`` -> ``parts``."""
