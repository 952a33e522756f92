"""Scripts that measure parnas (run as ``python benchmarks/NAME.py``); a package only so the import checks see them."""
