"""Developer tools of the hotweights repository (not shipped in the package)."""
