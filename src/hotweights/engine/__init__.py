"""hotweights.engine"""
