"""Scripts for maintainers (run as ``python tools/NAME.py``); a package only so the import checks see them."""
