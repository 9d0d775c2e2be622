"""Hardware profiles shipped with parsim (package data: ``importlib.resources.files("parsim.profiles")``)."""
